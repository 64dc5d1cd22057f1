"""Files runner writes and keeps: the one atomic write (a reader sees the old file or the new one, never half of
one), the one cache folder, installed versions.

The atomic write writes a temporary file beside the target, fsyncs it, os.replaces it over the target, then fsyncs
the folder so the rename itself survives a crash. Raises OSError; callers turn it into the error their user needs
(naming the file).
Imports nothing of runner: every layer may use it.
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from importlib import metadata
from pathlib import Path


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Replace `path` with `data` (text is written as UTF-8), creating its folder if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    if os.name == "posix":
        with suppress(OSError):
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return path


def atomic_write_json(path: str | Path, data, **dumps) -> Path:
    """`atomic_write` of `json.dumps(data, indent=2, default=str)` plus a final newline."""
    return atomic_write(path, json.dumps(data, **{"indent": 2, "default": str, **dumps}) + "\n")


def cache_dir() -> Path:
    """runner's one cache folder, for everything it keeps between runs (models, texts, codebooks, plans' memos, the
    C++ kernels, inductor's caches): `$RUNNER_CACHE` when set, else ~/.cache/runner. Read at each call, not import."""
    chosen = os.environ.get("RUNNER_CACHE")
    return Path(chosen) if chosen else Path.home() / ".cache" / "runner"


def package_version(package: str) -> str | None:
    """The installed version of `package` (its distribution metadata), or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
