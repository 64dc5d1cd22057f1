"""Fitted nuq codebooks on disk: fitted once and read back; a file that is corrupt or does not fit this model and
these options (another layer count, level count, model) is fitted again with a warning naming it, never used; a cache
folder that cannot hold them is a warning, never a failure."""

import json

import pytest

from runner.infer.cache import codebooks
from runner.infer.config.kinds import parse_kind

KIND = "kivi2:g32:r32:nuq"  # 2 bits: 4 key and 4 value levels per layer


@pytest.fixture
def cache(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(codebooks, "_FITTED", {})  # a process that has fitted nothing
    return tmp_path / "cache" / "codebooks"


def _fit(tiny_lm):
    return codebooks.fitted_levels(tiny_lm.model, parse_kind(KIND))


def _file(cache):
    (path,) = cache.iterdir()
    return path


def test_fitted_once_then_read_from_the_file(tiny_lm, cache, monkeypatch):
    first = _fit(tiny_lm)
    doc = json.loads(_file(cache).read_text())
    assert len(doc["levels"]) == 2 and [len(side) for side in doc["levels"][0]] == [4, 4]
    monkeypatch.setattr(codebooks, "_FITTED", {})
    monkeypatch.setattr(codebooks, "fit_model_levels", lambda *a: pytest.fail("fitted again a codebook on disk"))
    again = _fit(tiny_lm)
    assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(first, again))


def _bad(doc: dict, case: str):
    if case == "one layer":
        doc["levels"] = doc["levels"][:1]
    elif case == "3 key levels":
        doc["levels"][1][0] = doc["levels"][1][0][:3]
    elif case == "no bits":
        del doc["bits"]
    elif case == "another model":
        doc["model"] = {"source": "config:gpt2"}
    elif case == "a level that is text":
        doc["levels"][0][1][2] = "x"
    return json.dumps(doc)


@pytest.mark.parametrize("case, problem", [
    ("one layer", "has 1 layers; the model has 2"),
    ("3 key levels", "layer 1: 3 key levels; 2 bits take 4"),
    ("no bits", "lacks bits"),
    ("another model", "is for model {'source': 'config:gpt2'}, not "),
    ("a level that is text", "layer 0: a value level that is not a finite number"),
    ("truncated", "is not JSON (Expecting value: line 1 column 201 (char 200))"),
])
def test_a_codebook_that_does_not_fit_is_fitted_again_with_a_warning(tiny_lm, cache, monkeypatch, caplog, case,
                                                                     problem):
    _fit(tiny_lm)
    path = _file(cache)
    good = path.read_text()
    path.write_text(good.replace("\n", "")[:200] if case == "truncated" else _bad(json.loads(good), case))
    monkeypatch.setattr(codebooks, "_FITTED", {})
    with caplog.at_level("WARNING", logger=codebooks.__name__):
        levels = _fit(tiny_lm)
    (message,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert message.startswith(f"codebook {path} {problem}") and message.endswith(": fitting it again")
    assert len(levels) == 2 and json.loads(path.read_text()) == json.loads(good)  # refitted and rewritten


def test_a_cache_folder_that_cannot_hold_codebooks_is_a_warning(tiny_lm, cache, caplog):
    cache.parent.mkdir()
    cache.write_text("")  # a file where the codebooks folder should be
    with caplog.at_level("WARNING", logger=codebooks.__name__):
        levels = _fit(tiny_lm)
    assert len(levels) == 2
    (message,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert message.startswith(f"cannot write {cache}/") and message.endswith(
        f".json in runner's cache folder {cache.parent}: {cache} is a file, not a folder; set RUNNER_CACHE to a "
        "writable folder; the fitted codes serve this process only")
