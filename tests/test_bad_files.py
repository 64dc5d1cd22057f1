"""Bad files and bad command lines that the catalogue's format cannot hold: special files, symlink loops made
here, sizes past the bounds, the `run results` options, and the fuzzing of overrides and fragments. Each gets
exit 2 with its reason, fast, and no traceback."""

import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.cli import main
from runner.errors import InputFileError, ManifestError
from runner.manifest import paths
from runner.manifest.compose import load_manifest, load_points
from runner.manifest.plan import make_plan

MANIFEST = """targets:
  - name: smol
    runs:
      - id: g
        mode: generate
        generate: {GENERATE}
"""


def manifest(folder: Path, generate: str = "{}", name: str = "m.yaml", head: str = "") -> Path:
    path = folder / name
    path.write_text(head + MANIFEST.replace("{GENERATE}", generate), encoding="utf-8")
    return path


def check(capsys, *argv) -> list[str]:
    code = main(["check", *map(str, argv)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    return err.splitlines()


def test_a_manifest_that_is_a_symlink_loop_says_so(tmp_path, capsys):
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    assert check(capsys, tmp_path / "a.yaml")[1].strip() == f"{tmp_path / 'a.yaml'}: <top>: cannot read: a symlink loop"


def test_a_manifest_that_is_a_fifo_or_a_folder_is_refused_without_reading_it(tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe.yaml")  # reading it would block forever
    assert check(capsys, tmp_path / "pipe.yaml")[1].strip().endswith("pipe.yaml: <top>: file: not a regular file")
    (tmp_path / "dir.yaml").mkdir()
    assert check(capsys, tmp_path / "dir.yaml")[1].strip().endswith("dir.yaml: <top>: file: not a regular file")


def test_a_huge_manifest_is_refused_by_its_size(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    with path.open("wb") as f:
        f.truncate(50 * 2**20)  # sparse: nothing is read
    assert "bytes; a manifest or fragment is at most 4,194,304" in check(capsys, path)[1]


def test_a_prompts_file_over_the_bound_is_refused_without_reading_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(paths, "MAX_INPUT_MB", 1)
    with (tmp_path / "p.txt").open("wb") as f:
        f.truncate(3 * 2**20)
    path = manifest(tmp_path, "{prompts_file: p.txt}")
    line = check(capsys, path)[1].strip()
    assert line == (f"{path}:6:20: targets[0].runs[0].generate.prompts_file: prompts file 'p.txt' is 3 MiB; input "
                    "text files are limited to 1 MiB (set RUNNER_MAX_INPUT_MB to raise the limit)")


def test_utf8_is_checked_streaming_across_chunks_with_the_right_line(tmp_path):
    good = tmp_path / "good.txt"
    text = ("x" * (paths.CHUNK - 1) + "é\n") * 2  # a two-byte character split by every chunk boundary
    good.write_text(text, encoding="utf-8")
    assert paths.input_file("good.txt", tmp_path, "prompts").digest
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"line\n" * 300_000 + b"caf\xe9\n")
    with pytest.raises(InputFileError, match=r"byte 0xe9 at offset 1500003, line 300001\)"):
        paths.input_file("bad.txt", tmp_path, "prompts")
    truncated = tmp_path / "cut.txt"
    truncated.write_bytes("abc é".encode()[:-1])
    with pytest.raises(InputFileError, match="ends inside a character"):
        paths.input_file("cut.txt", tmp_path, "prompts")


def test_the_step_hash_covers_every_input_file_the_step_reads(tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    (tmp_path / "eval.txt").write_text("some evaluation text\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    path = manifest(tmp_path, "{prompts_file: p.txt, cache_quality_data: eval.txt}")
    path.write_text(path.read_text().replace("  - name: smol\n", "  - name: smol\n    model: {id: ./model}\n"))

    def step_hash():
        return make_plan(load_manifest(path)[0], tmp_path).steps[0].hash

    hashes = [step_hash()]
    for changed in ("p.txt", "eval.txt", "model/config.json"):
        time.sleep(0.01)
        (tmp_path / changed).write_text((tmp_path / changed).read_text() + " ")
        hashes.append(step_hash())
    assert len(set(hashes)) == 4, "each input file's change changes the step's hash"


def test_check_and_the_steps_resolve_home_the_same_way(tmp_path, monkeypatch, capsys):
    from runner.manifest.blocks import GenerateBlock
    from runner.steps.shared import load_prompts

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "p.txt").write_text("from home\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert main(["check", str(manifest(elsewhere, "{prompts_file: ~/p.txt}"))]) == 0
    assert load_prompts(GenerateBlock(prompts_file="~/p.txt"), elsewhere) == ["from home"]


def test_a_prompts_file_broken_after_check_fails_its_step_with_our_error(tmp_path):
    from runner.manifest.blocks import GenerateBlock
    from runner.steps.shared import load_prompts

    (tmp_path / "p.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(InputFileError, match="is not UTF-8 text"):  # a RunnerError: the engine records the step
        load_prompts(GenerateBlock(prompts_file="p.txt"), tmp_path)


def test_valid_inputs_still_pass(tmp_path, capsys):
    """The checks refuse what is wrong, not what is unusual: an optional fragment that is not there, a byte-order
    mark, a date as a name, a prompts file whose last line has no newline."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b", "extra": 1}')
    path = manifest(tmp_path, "{prompts_file: p.jsonl}",
                    head="\ufeffname: 2024-01-01\ndefaults:\n  - optional frags@models.m: absent\n  - _self_\n")
    assert main(["check", str(path)]) == 0, capsys.readouterr().err


def test_a_thousand_point_sweep_is_composed_by_hydra_once(tmp_path, monkeypatch):
    from runner.manifest import compose

    path = manifest(tmp_path)
    calls = []
    real = compose._compose
    monkeypatch.setattr(compose, "_compose", lambda *a, **k: calls.append(a) or real(*a, **k))
    points = [(f"++seed={i}", f"++targets.0.runs.0.generate.temperature={i % 7 / 10}") for i in range(1000)]
    points[500] = ("++seed=-1",)
    outcome = load_points(path, points)
    assert len(calls) == 1
    assert [i for i, e in enumerate(outcome) if e is not None] == [500]
    assert "greater than or equal to 0" in str(outcome[500])


def test_fast_point_validation_agrees_with_a_full_composition(tmp_path):
    """Points are validated on the resolved manifest only when no interpolation reads what they set."""
    path = manifest(tmp_path, head="models:\n  m: {id: zoo:smollm2-135m, dtype: float32}\n")
    path.write_text(path.read_text().replace("  - name: smol\n", "  - name: smol\n    model: ${models.m}\n"))
    points = [("++models.m.dtype=float64",), ("++seed=3",), ("++targets.0.model.dtype=float64",),
              ("++models.m.device=gpu", "++seed=-1"), ("++name=${seed}",)]
    for point, fast in zip(points, load_points(path, points)):
        try:
            load_manifest(path, list(point))
            full = None
        except ManifestError as exc:
            full = exc
        assert str(fast) == str(full), point
    assert [e is None for e in load_points(path, points)] == [False, True, False, False, False]


def test_check_of_a_thousand_point_sweep_answers(tmp_path, capsys):
    path = manifest(tmp_path, head="sweep: {seed: 'range(0,1000)'}\n")
    assert main(["check", str(path)]) == 0
    assert "sweep of 1000 points, each valid" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["results", "--where", "temperature"], ("error: --where 'temperature': expected KEY=VALUE (e.g. --where "
                                             "sweep.temperature=0.7)")),
    (["results", "--limit", "-3"], "error: argument --limit: expected a positive whole number, got '-3'"),
    (["results", "--limit", "0"], "error: argument --limit: expected a positive whole number, got '0'"),
    (["results", "--tracking-uri", "sqlit:///x.db"], ("error: --tracking-uri: unknown tracking URI scheme 'sqlit': "
                                                      "did you mean 'sqlite://'?")),
    (["compare", "a", "b", "--tracking-uri", "gopher://x"], "error: --tracking-uri: unknown tracking URI scheme"),
    (["results", "--tracking-uri", "sqlite:///no-such.db"], "error: --tracking-uri: no MLflow store at"),
])
def test_results_and_compare_refuse_bad_options(argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mlflow.db").write_bytes(b"")
    with pytest.raises(SystemExit) if "--limit" in argv else _nothing() as raised:
        code = main(argv)
    err = capsys.readouterr().err
    assert (raised.value.code if raised else code) == 2 and "Traceback" not in err
    assert any(line.startswith(expected) for line in err.splitlines()), err
    assert not (tmp_path / "no-such.db").exists(), "MLflow did not create a store"


def test_results_on_a_store_that_is_not_mlflow_is_our_error(tmp_path, capsys):
    db = tmp_path / "other.db"
    db.write_bytes(b"this is not a database at all" * 100)
    code = main(["results", "--tracking-uri", f"sqlite:///{db}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"error: cannot read the MLflow store sqlite:///{db}: ")


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


OVERRIDE_PIECES = st.sampled_from(["seed", "=", "==", "1", "-1", "true", "yes", "targets", ".", "0", "runs", "5",
                                   "generate", "temperature", "[", "]", "(", ")", "range(0,3)", "a,b", "${", "}",
                                   "oc.env:HOME", "'", "\"", "~", "+", "++", "name", "@", "/", " ", "1e30", "null",
                                   "max_new_tokens", "x" * 300, "\\", ":", "hydra", "models"])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(OVERRIDE_PIECES, min_size=1, max_size=8).map("".join), min_size=1, max_size=3))
def test_fuzzed_overrides_raise_only_our_error(tmp_path, overrides):
    path = manifest(tmp_path)
    try:
        load_manifest(path, overrides)
    except ManifestError as exc:
        assert str(exc).startswith("invalid manifest")


FRAGMENT_PIECES = st.sampled_from([
    "id: zoo:smollm2-135m", "dtype: float32", "dtype: float64", "dtyp: x", "device: gpu", "- item", "&a [*a]",
    "a: &a [x, x]", "b: [*a, *a]", "'quoted", "key: [", "\t- tab", "!!python/object:os.system", "defaults:",
    "  - other", "  - ../up", "${oc.env:HOME}", "x: ${nope}", "<<: 5", "? [a]", ": b", "~: 1", "1: 2", "yes: no",
    "# @package _global_", "seed: true", "name: x\nname: y", "%YAML 1.1", "---", "..."])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(FRAGMENT_PIECES, max_size=8).map("\n".join), st.sampled_from(["frags@models.m: f", "frags/f"]))
def test_fuzzed_fragments_raise_only_our_error(tmp_path, text, entry):
    (tmp_path / "frags").mkdir(exist_ok=True)
    (tmp_path / "frags" / "f.yaml").write_text(text, encoding="utf-8")
    (tmp_path / "frags" / "other.yaml").write_text("dtype: float32\n", encoding="utf-8")
    path = manifest(tmp_path, head=f"defaults:\n  - {entry}\n  - _self_\n")
    try:
        load_manifest(path)
    except ManifestError as exc:
        assert str(exc).startswith("invalid manifest")
