"""The one driver of a load: every server under test (our continuous scheduler, the static-batching baseline,
transformers' continuous batching) is fed the same requests at the same scheduled times by this loop.

A server is anything with `submit(request) -> RequestRecord` (at the request's arrival; the record may come back
finished at once: refused), `step()` (do the work that can be done now: a decode step, a whole static batch, a
poll), `busy` (work is waiting or running), a `clock` the driver sets to the load's (the times a server records
are on it) and, optionally, `wake_s` (the load time at which a server that holds work but cannot start it yet wants
to be stepped again: a static batch waiting to fill; None: step it now) and `wait(seconds)` (sleeps the driver as
`sleep` does, ending early when the server has news: a remote server's finished request). A server may serve several
loads in turn (a warm-up, then the load), each on its own clock.

What follows a finished request (a conversation's next turn, a closed-loop user's next request) is asked of the
Load as soon as the driver sees it finished, and arrives at that moment. Latencies are measured from each request's
scheduled `arrival_s`, so a driver that is late to submit (the server was busy in a long step) hides no queueing.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from runner.infer.serve.load import Load
from runner.infer.serve.requests import Request, RequestRecord

Clock = Callable[[], float]
Sleep = Callable[[float], None]


class Server(Protocol):
    clock: Clock

    def submit(self, request: Request) -> RequestRecord: ...

    def step(self) -> None: ...

    @property
    def busy(self) -> bool: ...


def load_clock() -> Clock:
    """Seconds since this load started, on the monotonic clock (time.perf_counter, shifted)."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


def drive(server: Server, load: Load | Sequence[Request], clock: Clock, sleep: Sleep,
          on_finish: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
    """Serve `load` (a Load, with its follow-ups; or plain requests) on `server` → every request's record, in
    request-id order. `on_finish` sees each record as it finishes (progress)."""
    server.clock = clock
    pause = getattr(server, "wait", None) or sleep  # a server whose news comes from threads of its own ends a sleep
    requests = load.requests if isinstance(load, Load) else list(load)
    pending: list[tuple[float, int, Request]] = [(r.arrival_s, r.id, r) for r in requests]
    heapq.heapify(pending)
    open_: dict[int, RequestRecord] = {}
    done: dict[int, RequestRecord] = {}
    while pending or open_:
        now = clock()
        while pending and pending[0][0] <= now:
            request = heapq.heappop(pending)[2]
            open_[request.id] = server.submit(request)
        if server.busy and _due(server, now):
            server.step()
        else:
            wakes = [pending[0][0]] if pending else []
            if server.busy:
                wakes.append(getattr(server, "wake_s", None) or now)
            elif not pending and any(not record.finish for record in open_.values()):
                raise RuntimeError("the server is idle with requests unfinished")  # a bug in the server
            if wakes:
                pause(max(0.0, min(wakes) - now))
        for rid in [rid for rid, record in open_.items() if record.finish]:
            record = done[rid] = open_.pop(rid)
            if on_finish is not None:
                on_finish(record)
            follow = load.follow_up(record, clock()) if isinstance(load, Load) else None
            if follow is not None:
                heapq.heappush(pending, (follow.arrival_s, follow.id, follow))
    return [done[rid] for rid in sorted(done)]


def _due(server: Server, now: float) -> bool:
    wake = getattr(server, "wake_s", None)
    return wake is None or wake <= now
