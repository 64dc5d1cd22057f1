"""The one atomic write: the old file or the new one, never half; nothing left behind when it fails."""

import json
import os
import re
from pathlib import Path

import pytest

from runner.files import atomic_write, atomic_write_json


def test_replaces_whole_and_creates_folders(tmp_path):
    target = tmp_path / "a" / "b" / "status.json"
    atomic_write_json(target, {"state": "running"})
    atomic_write(target, "new text")
    assert target.read_text() == "new text"
    assert sorted(os.listdir(target.parent)) == ["status.json"]  # no temporary file left


def test_json_is_indented_with_a_final_newline_and_strings_for_the_rest(tmp_path):
    target = atomic_write_json(tmp_path / "x.json", {"path": tmp_path, "n": 1})
    text = target.read_text()
    assert text.endswith("}\n") and json.loads(text) == {"path": str(tmp_path), "n": 1}


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "plans.json"
    target.write_text("old")

    class Unwritable:  # not str or bytes: fails inside the write, after the temporary file was opened
        pass

    with pytest.raises(TypeError):
        atomic_write(target, Unwritable())
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["plans.json"]


def test_an_unwritable_folder_raises_oserror(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(OSError):
        atomic_write(blocked / "x.json", "{}")  # a file where the folder should be


def test_inductor_caches_in_a_cache_folder_that_cannot_hold_them_are_a_warning(tmp_path, monkeypatch, caplog):
    import torch._inductor.config as inductor_config

    from runner.infer.compiled import engine

    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with caplog.at_level("WARNING", logger=engine.__name__), inductor_config.patch(fx_graph_cache=False):
        engine.use_compile_cache()  # the patch puts back what was there (before the next test: its monkeypatch of
        # fx_graph_cache leaves torch reporting the option as hidden to a later read)
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot write {tmp_path}/cache/inductor in runner's cache folder {tmp_path}/cache: {tmp_path}/cache is a "
        "file, not a folder; set RUNNER_CACHE to a writable folder; inductor keeps its caches in its default "
        "temporary folder instead"]


def test_runner_cache_moves_every_cache_folder(tmp_path, monkeypatch):
    """One cache folder: $RUNNER_CACHE moves the downloads, the codebooks, the C++ kernels and inductor's caches."""
    import torch._inductor.config as inductor_config

    from runner.files import cache_dir
    from runner.infer.compiled import engine
    from runner.infer.kernels import native
    from runner.infer.loading import pinned, zoo

    monkeypatch.delenv("RUNNER_CACHE", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "runner"
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    assert pinned.cache_root() == tmp_path / "elsewhere"  # zoo models, GGUF files, texts, codebooks, content hashes
    assert zoo._model_dir(zoo.zoo_entry("zoo:smollm2-135m")).parent == tmp_path / "elsewhere" / "models"
    assert native.kernel_dir() == tmp_path / "elsewhere" / "kernels"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(inductor_config, "fx_graph_cache", inductor_config.fx_graph_cache)
    engine.use_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "elsewhere" / "inductor")


def test_no_module_names_the_cache_folder_itself():
    """Every cache path comes from runner.files.cache_dir: no other module spells ~/.cache."""
    root = Path(__file__).parents[1] / "runner"
    spelt = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if p.name != "files.py" and re.search(r"""["']\.cache["']""", p.read_text())]
    assert spelt == []


def test_package_version_is_the_installed_one_or_none():
    from importlib import metadata

    from runner.files import package_version

    assert package_version("pytest") == metadata.version("pytest")
    assert package_version("no-such-package-runner-test") is None


def test_cache_folder_is_made_and_returned(tmp_path, monkeypatch):
    from runner.files import cache_folder, cache_write

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    assert cache_folder("codebooks") == tmp_path / "cache" / "codebooks" and (tmp_path / "cache" / "codebooks").is_dir()
    assert cache_write(tmp_path / "cache" / "a" / "b.json", "{}").read_text() == "{}"


def test_runner_cache_that_is_a_file_is_a_cache_error_naming_it(tmp_path, monkeypatch):
    """Fails for root too: no permission bits involved."""
    from runner.errors import CacheError, RunnerError
    from runner.files import cache_folder, cache_write

    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CacheError) as raised:
        cache_folder("models")
    assert isinstance(raised.value, RunnerError)
    assert str(raised.value) == (f"cannot write {tmp_path}/cache/models in runner's cache folder {tmp_path}/cache: "
                                 f"{tmp_path}/cache is a file, not a folder; set RUNNER_CACHE to a writable folder")
    with pytest.raises(CacheError) as raised:
        cache_write(tmp_path / "cache" / "codebooks" / "x.json", "{}")
    assert str(raised.value) == (f"cannot write {tmp_path}/cache/codebooks/x.json in runner's cache folder "
                                 f"{tmp_path}/cache: {tmp_path}/cache is a file, not a folder; set RUNNER_CACHE to a "
                                 "writable folder")


def test_a_subfolder_that_is_a_file_is_a_cache_error_naming_it(tmp_path, monkeypatch):
    from runner.errors import CacheError
    from runner.files import cache_folder

    (tmp_path / "kernels").write_text("")
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    with pytest.raises(CacheError, match="^cannot write .*: (.*) is a file, not a folder; set RUNNER_CACHE") as raised:
        cache_folder("kernels")
    assert f": {tmp_path}/kernels is a file, not a folder;" in str(raised.value)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into a folder whatever its permission bits say: no error to see")
def test_a_read_only_cache_folder_is_a_cache_error_naming_it(tmp_path, monkeypatch):
    from runner.errors import CacheError
    from runner.files import cache_folder, cache_write

    (tmp_path / "cache" / "codebooks").mkdir(parents=True)
    (tmp_path / "cache").chmod(0o500)
    (tmp_path / "cache" / "codebooks").chmod(0o500)
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    try:
        with pytest.raises(CacheError) as raised:
            cache_folder("codebooks")
        assert str(raised.value) == (f"cannot write {tmp_path}/cache/codebooks in runner's cache folder "
                                     f"{tmp_path}/cache: {tmp_path}/cache/codebooks is not writable (permission "
                                     "denied); set RUNNER_CACHE to a writable folder")
        with pytest.raises(CacheError) as raised:
            cache_write(tmp_path / "cache" / "models" / "x", "")
        assert f": {tmp_path}/cache is not writable (permission denied);" in str(raised.value)
    finally:
        (tmp_path / "cache" / "codebooks").chmod(0o700)
        (tmp_path / "cache").chmod(0o700)



def test_a_journal_reads_back_what_was_appended_and_skips_a_torn_last_line(tmp_path):
    from runner.files import append_json_line, read_json_lines

    journal = tmp_path / "step" / "samples.jsonl"
    assert read_json_lines(journal) == []
    append_json_line(journal, {"n": 1, "text": "a\nb"})
    append_json_line(journal, {"n": 2})
    with open(journal, "a") as f:
        f.write('{"n": 3, "te')  # a crash in the middle of the third line
    assert read_json_lines(journal) == [{"n": 1, "text": "a\nb"}, {"n": 2}]
