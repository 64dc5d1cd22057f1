"""The one thread that owns the scheduler: `submit`, `step` and `cancel` happen only here, so the scheduler (not
thread-safe: its queues, caches and block pool) never sees two threads. HTTP handlers talk to it through a thread-safe
inbox and get their tokens back through a `Sink` each: a callable the engine thread calls with every `Event` of its
request (the HTTP layer's sink hands the event to its asyncio loop with call_soon_threadsafe; the engine knows
nothing of asyncio).

Every request gets, in order: one event saying it was accepted (`code` 200) or refused at submission (429: the
waiting queue is full; 400: it cannot fit in the KV budget or the slots, `error` says why), then events carrying its
new tokens as steps make them, the last one with `finish` set ("eos", "length", "stop", "cancelled", or "error"
with code 500 when a step failed). Times are on the loop's clock (`now`), which the scheduler records with, so a
request's TTFT counts from when the HTTP layer stamped its arrival.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from runner.infer.serve.driver import load_clock
from runner.infer.serve.requests import Request, RequestRecord
from runner.infer.serve.scheduler import Scheduler
from runner.infer.server.prometheus import ServerMetrics

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.25  # an idle engine waits this long for work before refreshing the gauges


@dataclass
class Event:
    """What the engine tells one request's handler."""

    code: int = 200  # 200, or the HTTP status of a refusal (429 queue full, 400 too long, 500 a failed step)
    tokens: list[int] = field(default_factory=list)  # new output tokens since the last event
    finish: str = ""  # set on the last event: the scheduler's finish
    error: str = ""
    record: RequestRecord | None = None  # on the last event: what happened to the request


Sink = Callable[[Event], None]


@dataclass
class _Open:
    sink: Sink
    record: RequestRecord
    sent: int = 0  # output tokens already sent


class EngineLoop:
    """The engine thread over `scheduler`: `start`, then `submit` / `cancel` from any thread; `close` at the end."""

    def __init__(self, scheduler: Scheduler, metrics: ServerMetrics | None = None):
        self.scheduler = scheduler
        self.metrics = metrics or ServerMetrics()
        self.now = load_clock()  # the load's clock: seconds since the server started
        scheduler.clock = self.now
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._id_lock = threading.Lock()
        self._open: dict[int, _Open] = {}
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runner-engine", daemon=True)
        self.counts = (0, 0, 0)  # (running, waiting, KV blocks used) after the engine's last step
        self.metrics.kv_blocks_total.set(min(scheduler.pool.total, 2**53))

    def start(self) -> None:
        self._thread.start()

    def new_id(self) -> int:
        with self._id_lock:
            return next(self._ids)

    def submit(self, request: Request, sink: Sink) -> None:
        self._inbox.put(("submit", request, sink))

    def cancel(self, request_id: int) -> None:
        """Free the request's slot and blocks now (its client went away); it finishes "cancelled"."""
        self._inbox.put(("cancel", request_id))

    def cancel_all(self) -> None:
        self._inbox.put(("cancel_all",))

    @property
    def in_flight(self) -> int:
        """Requests accepted and not finished (read from any thread: an int, never torn)."""
        return len(self._open)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread: what is still open finishes "cancelled"."""
        self._closing.set()
        self._inbox.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # --- the engine thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing.is_set():
            self._take(block=not self.scheduler.busy)
            if self.scheduler.busy and not self._closing.is_set():
                before = sum(len(o.record.output_ids) for o in self._open.values())
                try:
                    self.scheduler.step()
                except Exception as exc:  # a bug: every open request fails with it, the server goes on
                    log.exception("a scheduler step failed; failing the %d open requests", len(self._open))
                    self._fail_all(f"the engine failed: {type(exc).__name__}: {exc}")
                self.scheduler.timeline.clear()  # a server runs for days: keep no per-step history
                self.metrics.generated(sum(len(o.record.output_ids) for o in self._open.values()) - before,
                                       self.now())
            self._deliver()
            self._gauges()
        for rid in list(self._open):
            self.scheduler.cancel(rid)
        self._deliver()

    def _take(self, block: bool) -> None:
        """Apply what the inbox holds; wait for the first command when the scheduler is idle."""
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        what = command[0]
        if what == "submit":
            request, sink = command[1], command[2]
            record = self.scheduler.submit(request)
            if record.finish:  # refused at once: queue full (429) or cannot ever fit (400)
                self.scheduler.records.pop(request.id, None)
                self.metrics.finished(record)
                _send(sink, Event(429 if record.finish == "refused" else 400, finish=record.finish,
                                  error=record.error, record=record))
                return
            self.metrics.prompt_tokens.inc(len(request.prompt_ids))
            self._open[request.id] = _Open(sink, record)
            _send(sink, Event(200))
        elif what == "cancel":
            self.scheduler.cancel(command[1])
        elif what == "cancel_all":
            for rid in list(self._open):
                self.scheduler.cancel(rid)

    def _deliver(self) -> None:
        """Send each open request its new tokens; the finished ones their last event."""
        for rid, open_ in list(self._open.items()):
            record = open_.record
            new = record.output_ids[open_.sent:]
            if not new and not record.finish:
                continue
            open_.sent += len(new)
            if record.finish:
                del self._open[rid]
                self.scheduler.records.pop(rid, None)
                self.metrics.finished(record)
                code = 500 if record.finish == "error" else 200
                _send(open_.sink, Event(code, list(new), record.finish, record.error, record))
            else:
                _send(open_.sink, Event(200, list(new)))

    def _fail_all(self, error: str) -> None:
        for rid, open_ in self._open.items():
            try:
                self.scheduler.cancel(rid)
            except Exception:  # the failed step may have left it half-placed: its record still says what happened
                log.exception("cancelling request %d after the failure", rid)
            open_.record.finish, open_.record.error = "error", error

    def _gauges(self) -> None:
        s = self.scheduler
        self.counts = (len(s.running), len(s.waiting), s.pool.used)
        self.metrics.state(*self.counts, s.kv_bytes(), self.now())


def _send(sink: Sink, event: Event) -> None:
    """An event to its handler; a handler that can no longer take it (its loop closed as the server stops) is
    skipped, never the engine thread's end."""
    try:
        sink(event)
    except RuntimeError as exc:
        log.debug("an event was not delivered: %s", exc)
