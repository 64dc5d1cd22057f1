"""The cache-plan store: `plans/cache_plans.json`, one cache plan per fingerprint of everything that could change
the answer.

Owns the file: its format (`{"version": 1, "plans": {key: cache plan}}`), the key (sha256 of the canonical JSON of
the caller's fields, which are kept in the cache plan so a human can see why two keys differ), freshness, atomic
writes (temp file, fsync, os.replace) under a cross-process lock on `<path>.lock` so concurrent writers lose nothing,
and setting a corrupt file aside (never overwriting it silently). Does not know what a cache plan means, how
candidates are measured, or which fields matter: auto-cache-select decides those.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, Timeout

from runner import __version__
from runner.errors import RunnerError
from runner.files import atomic_write_json

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_PATH = Path("plans") / "cache_plans.json"
LOCK_TIMEOUT_SEC = 120.0


def cache_plan_key(fields: dict) -> str:
    """sha256 hex of the canonical JSON of `fields`: the same fields in any order give the same key."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class CachePlanStore:
    """Cache plans in one JSON file. Reads need no lock (writes replace the file whole); writes hold `<path>.lock`."""

    def __init__(self, path: str | Path = DEFAULT_PATH):
        self.path = Path(path)
        self._lock = FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_SEC)

    def get(self, key: str) -> dict | None:
        return self._read().get(key)

    def put(self, key: str, cache_plan: dict, fields: dict) -> dict:
        """Store `cache_plan` under `key` (which must be `cache_plan_key(fields)`), adding fields, creation time and
        version."""
        if key != cache_plan_key(fields):
            raise ValueError(f"cache plan key {key} is not cache_plan_key(fields) = {cache_plan_key(fields)}")
        now = time.time()
        stored = {**cache_plan, "fields": fields, "created": datetime.fromtimestamp(now, timezone.utc).isoformat(),
                  "created_unix": now, "runner_version": __version__}
        stored = json.loads(json.dumps(stored))  # fails here, before the file is touched, if it is not JSON
        with self._locked():
            plans = self._load()
            plans[key] = stored
            self._write({"version": FORMAT_VERSION, "plans": plans})
        return stored

    @staticmethod
    def is_fresh(cache_plan: dict, probe: bool, interval_sec: float, now: float | None = None) -> bool:
        """Fresh when probing is off, or when the cache plan is younger than `interval_sec`."""
        if not probe:
            return True
        age = _age(cache_plan, now)
        return age is not None and age < interval_sec

    def lookup(self, key: str, probe: bool, interval_sec: float, now: float | None = None,
               validate: Callable[[dict], str] | None = None) -> tuple[dict | None, str]:
        """The cache plan if it may be reused (else None: re-measure), and why: "fresh ...", "stale ...", "missing"
        or "unusable (...)" when `validate` (the caller's check of what a plan holds) names a problem, which is also
        said at warning level naming the file: the plan is measured again and replaced, never used as is."""
        cache_plan = self.get(key)
        if cache_plan is None:
            return None, "missing"
        problem = validate(cache_plan) if validate else ""
        if problem:
            log.warning("cache plan %s in %s is unusable (%s): measuring again", key[:12], self.path, problem)
            return None, f"unusable ({problem})"
        now = time.time() if now is None else now  # one clock reading for the verdict and its reason
        age = _age(cache_plan, now)
        if not self.is_fresh(cache_plan, probe, interval_sec, now):
            return None, "stale (no creation time)" if age is None else f"stale (age {age:.0f} s >= {interval_sec:g} s)"
        return cache_plan, "fresh (probe off)" if not probe else f"fresh (age {age:.0f} s < {interval_sec:g} s)"

    # -- the file ---------------------------------------------------------------------------------------------------

    def _read(self) -> dict:
        plans, _ = self._parse()
        if plans is not None:
            return plans
        with self._locked():  # corrupt: look again under the lock (another process may have dealt with it)
            return self._load()

    def _load(self) -> dict:
        """The plans, setting a corrupt file aside. Call with the lock held."""
        plans, problem = self._parse()
        if plans is None:
            self._set_aside(problem)
            return {}
        return plans

    def _parse(self) -> tuple[dict | None, str]:
        """The plans in the file ({} when there is none), or None and what is wrong with it."""
        try:
            doc = json.loads(self.path.read_bytes())
        except (FileNotFoundError, NotADirectoryError):
            return {}, ""
        except OSError as exc:
            raise RunnerError(f"cannot read cache plans {self.path.resolve()}: {exc.strerror}") from None
        except ValueError as exc:
            return None, f"not JSON: {exc}"
        if not isinstance(doc, dict) or not isinstance(doc.get("plans"), dict):
            return None, 'not {"version": ..., "plans": {...}}'
        if doc.get("version") != FORMAT_VERSION:
            return None, f"version {doc.get('version')!r}, this runner reads version {FORMAT_VERSION}"
        if not all(isinstance(cache_plan, dict) for cache_plan in doc["plans"].values()):
            return None, "a plan that is not an object"
        return doc["plans"], ""

    def _set_aside(self, problem: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        aside, n = self.path.with_name(f"{self.path.name}.corrupt-{stamp}"), 1
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        try:
            os.replace(self.path, aside)
        except OSError as exc:
            raise RunnerError(f"cache plans {self.path.resolve()} are unreadable ({problem}) and cannot be moved "
                              f"aside: {exc.strerror}") from None
        log.warning("cache plans %s were unreadable (%s); moved them to %s and started with no plans", self.path,
                    problem, aside)

    def _write(self, doc: dict) -> None:
        """Replace the file whole: a reader sees the old file or the new one, never half of one."""
        try:
            atomic_write_json(self.path, doc, sort_keys=True, default=None)
        except OSError as exc:
            raise RunnerError(f"cannot write cache plans {self.path.resolve()}: {exc.strerror}") from None

    @contextmanager
    def _locked(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
        except Timeout:  # before OSError: Timeout is one
            raise RunnerError(f"cache plans {self.path.resolve()}: another process has held {self._lock.lock_file} "
                              f"for over {LOCK_TIMEOUT_SEC:.0f} s") from None
        except OSError as exc:
            raise RunnerError(f"cannot write cache plans {self.path.resolve()}: {exc.strerror or exc}") from None
        try:
            yield
        finally:
            self._lock.release()


def _age(cache_plan: dict, now: float | None) -> float | None:
    created = cache_plan.get("created_unix")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        return None
    return (time.time() if now is None else now) - created
