"""How runner speaks to a person, without printing: the CLI is the only printer.

Three channels, all silent until the CLI (or a caller) wires them:
    logging            status and warnings, on the logger of the module that speaks (`runner.*`)
    `show` / `stream`  what the user asked for (generated text, result tables) on the `runner.output` logger;
                       the CLI writes it to stdout, everything else to stderr
    `Progress`         long work reports what it has done through an object the caller's factory makes;
                       the CLI's draws bars
`configure` is the CLI's one-time set-up (`-v` shows debug messages, `-q` only warnings; output always shows).
Imports nothing of runner: every layer may use it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

OUTPUT = logging.getLogger("runner.output")


def show(text: str) -> None:
    """A result the user asked for (a generated text, a table): stdout under the CLI."""
    OUTPUT.info(text)


def stream(piece: str) -> None:
    """A piece of text as it is generated (no line break added)."""
    OUTPUT.info(piece, extra={"end": ""})


class Progress:
    """Long work reports through one of these: `update(n, note)` as units finish, `set_total` when the work turns
    out smaller, `close()` at the end. This one tells nobody; the CLI passes a subclass that draws a bar."""

    def __init__(self, description: str, total: int, unit: str):
        self.description, self.total, self.unit, self.done = description, total, unit, 0

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n

    def set_total(self, total: int) -> None:
        self.total = total

    def close(self) -> None:
        pass


ProgressFactory = Callable[[str, int, str], Progress]  # (description, total, unit) → a Progress for one task
no_progress: ProgressFactory = Progress


class _Console(logging.Handler):
    """`runner.output` to stdout as is; every other record to stderr as `[runner] message` (warnings say so).
    Looks the streams up at every record, so redirected or captured streams are honoured."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.name == OUTPUT.name:
                sys.stdout.write(record.getMessage() + getattr(record, "end", "\n"))
                sys.stdout.flush()
                return
            level = "" if record.levelno < logging.WARNING else f"{record.levelname}: "
            name = f" {record.name}" if self.level <= logging.DEBUG else ""
            sys.stderr.write(f"[runner{name}] {level}{record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never take the run down
            self.handleError(record)


def configure(verbosity: int = 0) -> None:
    """Once, by the CLI: verbosity −1 (-q) warnings only, 0 status, 1 (-v) debug. Output always shows."""
    root = logging.getLogger("runner")
    for handler in [h for h in root.handlers if isinstance(h, _Console)]:
        root.removeHandler(handler)
    handler = _Console(logging.DEBUG if verbosity > 0 else logging.INFO)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity > 0 else logging.INFO if verbosity == 0 else logging.WARNING)
    OUTPUT.setLevel(logging.INFO)
    root.propagate = False
