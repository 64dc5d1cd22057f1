"""Files runner writes and keeps: the one atomic write (a reader sees the old file or the new one, never half of
one), the one journal (JSON lines appended as work finishes, so an interrupted step keeps what it did), the one
cache folder, installed versions.

The atomic write writes a temporary file beside the target, fsyncs it, os.replaces it over the target, then fsyncs
the folder so the rename itself survives a crash. Raises OSError; callers turn it into the error their user needs
(naming the file). `cache_folder` and `cache_write` are the one place that makes folders and writes files under the
cache folder: they raise CacheError (a RunnerError) naming the path, what is wrong and what to do.
Imports nothing of runner but runner.errors: every layer may use it.
"""

from __future__ import annotations

import errno
import json
import os
from contextlib import suppress
from importlib import metadata
from pathlib import Path

from runner.errors import CacheError


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


def append_json_line(path: str | Path, record: dict) -> None:
    """Append `record` as one JSON line to `path` (created with its folder), flushed and fsynced: a crash can tear
    only the last line, which `read_json_lines` skips."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json_lines(path: str | Path) -> list[dict]:
    """The objects `append_json_line` wrote to `path` ([] when it does not exist); a torn line is skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        with suppress(json.JSONDecodeError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def cache_dir() -> Path:
    """runner's one cache folder, for everything it keeps between runs (models, texts, codebooks, plans' memos, the
    C++ kernels, inductor's caches): `$RUNNER_CACHE` when set, else ~/.cache/runner. Read at each call, not import."""
    chosen = os.environ.get("RUNNER_CACHE")
    return Path(chosen) if chosen else Path.home() / ".cache" / "runner"


def cache_folder(*parts: str) -> Path:
    """The folder `cache_dir()/parts`, made if needed and writable; CacheError when it cannot be."""
    folder = cache_dir().joinpath(*parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(folder))
    except OSError as exc:
        raise CacheError(cache_problem(folder, exc, folder=True)) from None
    return folder


def cache_write(path: Path, data: str | bytes) -> Path:
    """`atomic_write` of a file under the cache folder (its folder made first); CacheError when it cannot be."""
    try:
        return atomic_write(path, data)
    except OSError as exc:
        raise CacheError(cache_problem(path, exc)) from None


def cache_write_json(path: Path, data, **dumps) -> Path:
    """`cache_write` of `atomic_write_json`'s text."""
    return cache_write(path, json.dumps(data, **{"indent": 2, "default": str, **dumps}) + "\n")


def cache_problem(path: Path, exc: OSError, folder: bool = False) -> str:
    """What the user reads when `path` (a `folder`, else a file) under the cache folder cannot be made or written:
    the path, what is wrong (the first file where a folder should be, a folder without write permission, else the
    system's reason) and what to do."""
    above = [*reversed(path.parents), *([path] if folder else [])]
    blocker = next((p for p in above if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        why = f"{blocker} is a file, not a folder"
    elif isinstance(exc, PermissionError):
        why = f"{next((p for p in [path, *path.parents] if p.is_dir()), path)} is not writable (permission denied)"
    else:
        why = exc.strerror or str(exc)
    return (f"cannot write {path} in runner's cache folder {cache_dir()}: {why}; set RUNNER_CACHE to a writable "
            "folder")


def package_version(package: str) -> str | None:
    """The installed version of `package` (its distribution metadata), or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
