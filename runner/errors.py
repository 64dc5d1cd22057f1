"""User-facing failures. Each is reported once, completely, with exit status 2 and no traceback.

A traceback means a bug in runner; anything the user can fix (the manifest, a path, a model id,
memory) raises one of these instead.
"""

from __future__ import annotations

from dataclasses import dataclass


class ValueAt(ValueError):
    """A validator's error about a key below the object it validates (an item of a list, one run of a target, one
    strategy of a block): reported at that key. `shown` is the message read there."""

    def __init__(self, key: tuple, message: str, shown: str | None = None):
        self.key, self.shown = key, message if shown is None else shown
        super().__init__(message)


class RunnerError(Exception):
    """Base class: the message is what the user sees."""

    exit_code = 2


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a manifest: where it is and what was expected."""

    path: str  # key path, e.g. targets[0].runs[1].generate.top_p
    message: str  # what was expected
    source: str = ""  # "file.yaml:12:5" or "override 'a.b=c'"
    hint: str = ""  # e.g. "did you mean 'max_new_tokens'?"

    def __str__(self) -> str:
        where = f"{self.source}: " if self.source else ""
        hint = f" ({self.hint})" if self.hint else ""
        path = self.path or ("" if self.source.startswith(("override", "command line")) else "<top>")
        return f"{where}{path + ': ' if path else ''}{self.message}{hint}"


class ManifestError(RunnerError):
    """The manifest (or an override) is invalid; lists every problem at once."""

    def __init__(self, problems: list[Problem], file: str = ""):
        self.problems = problems
        self.file = file
        count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
        lines = [f"invalid manifest {file} ({count}):" if file else f"invalid manifest ({count}):"]
        lines += [f"  {p}" for p in problems]
        super().__init__("\n".join(lines))


class ModelError(RunnerError):
    """A model cannot be found, fetched, verified or loaded."""


class ResourceError(RunnerError):
    """The machine ran out of something (memory, disk) while doing what the manifest asked."""


class InputFileError(RunnerError):
    """A file the manifest names (prompts, evaluation text, a local model) is missing, unreadable or unfit."""


class StepError(RunnerError):
    """A step cannot run with the inputs given (e.g. a prompts file with no prompts)."""


class InferenceError(RunnerError):
    """The inference library cannot do what it was asked with these inputs: a prompt longer than max_seq_len,
    no cache kind within the budget or through the quality gates."""


class CacheError(RunnerError):
    """runner's cache folder ($RUNNER_CACHE, else ~/.cache/runner) cannot hold a file it must keep: a file where a
    folder should be, no write permission, a full disk. The message names the path, what is wrong and what to do."""


class DataError(RunnerError):
    """Evaluation text cannot be found, fetched, verified or is too short for what was asked."""


class ServerError(RunnerError):
    """`run serve` cannot start its HTTP server: the address is taken or refused, the run cannot be served."""


def format_loc(loc: tuple) -> str:
    """A key path as the user reads it: ("targets", 0, "runs") → targets[0].runs."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
