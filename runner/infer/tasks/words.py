"""The word lists RULER's tasks draw from: `wonderwords`' nouns, adjectives and verbs.

Owns: fetching the pinned wheel `wonderwords==3.0.1` (`pip download --no-deps`, sha256 verified, never a bad file
cached), reading its three lists out of the wheel as a zip (wonderwords is never imported or installed), and keeping
them as plain text under `cache_root()/data/wonderwords-3.0.1-<sha>/`. Does not know what the words are used for.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from runner.errors import DataError
from runner.files import cache_folder
from runner.infer.loading.pinned import cache_root, pip_download, publish_folder, sha256_file

WONDERWORDS_WHEEL = "wonderwords==3.0.1"
WONDERWORDS_FILE = "wonderwords-3.0.1-py3-none-any.whl"
WONDERWORDS_SHA256 = "4dd66deb6a76ca9e0b0422d1d3e111f9b910d7c16922d42de733ee8def98f8d0"
LISTS = {"nouns": "nounlist.txt", "adjectives": "adjectivelist.txt", "verbs": "verblist.txt"}


@dataclass(frozen=True)
class WordLists:
    """wonderwords' lists, in the file's order (as `wonderwords.random_word._get_words_from_text_file` reads them)."""

    nouns: tuple[str, ...]
    adjectives: tuple[str, ...]
    verbs: tuple[str, ...]


_loaded: dict[Path, WordLists] = {}


def word_lists() -> WordLists:
    """The nouns, adjectives and verbs of the pinned wonderwords wheel, fetched and verified on first use."""
    folder = _words_dir()
    if folder not in _loaded:
        _loaded[folder] = WordLists(*(tuple(_read(folder / f"{name}.txt")) for name in LISTS))
    return _loaded[folder]


def _read(path: Path) -> list[str]:
    return [line.rstrip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _words_dir() -> Path:
    target = cache_root() / "data" / f"wonderwords-3.0.1-{WONDERWORDS_SHA256[:12]}"
    if all((target / f"{name}.txt").exists() for name in LISTS):
        return target
    tmp = Path(tempfile.mkdtemp(dir=cache_folder("data"), prefix=".fetching-"))
    try:
        try:
            pip_download([WONDERWORDS_WHEEL], tmp, DataError, WONDERWORDS_WHEEL)
        except DataError as exc:
            raise DataError(f"{exc}\nRULER's word tasks (niah keys, cwe) need its word lists: make PyPI reachable "
                            f"once (the lists are then kept under {target.parent}), or set RUNNER_CACHE to a cache "
                            "folder that holds them") from None
        wheel = tmp / WONDERWORDS_FILE
        if not wheel.is_file():
            found = ", ".join(sorted(p.name for p in tmp.iterdir())) or "nothing"
            raise DataError(f"pip download of {WONDERWORDS_WHEEL} left {found}; expected {WONDERWORDS_FILE}")
        digest = sha256_file(wheel)
        if digest != WONDERWORDS_SHA256:
            raise DataError(f"{wheel.name} does not match its pin (sha256 {digest} vs {WONDERWORDS_SHA256}); "
                            "nothing was cached")
        out = tmp / "out"
        out.mkdir()
        try:
            with zipfile.ZipFile(wheel) as zf:
                for name, member in LISTS.items():
                    text = zf.read(f"wonderwords/assets/{member}").decode("utf-8")
                    (out / f"{name}.txt").write_text(text, encoding="utf-8")
        except (zipfile.BadZipFile, KeyError, UnicodeDecodeError) as exc:
            raise DataError(f"{wheel.name} (sha256 verified) lacks its word lists: {exc}") from None
        publish_folder(out, target, f"{next(iter(LISTS))}.txt")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
