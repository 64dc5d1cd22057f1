"""Starting and stopping the OpenAI-compatible server in this process: the scheduler (eager `Scheduler` or compiled
`CompiledSlots`), its engine thread, and uvicorn on a socket bound here (so a taken port is a clear error before any
model work, and port 0 picks a free one). uvicorn runs in a thread of its own and never touches signals: whoever
starts the server decides what Ctrl-C means (`run serve`: the first drains, a second cancels what runs).

    with serving(model, tokenizer, SchedulerConfig(...)) as server:   # 127.0.0.1, a free port
        openai.OpenAI(base_url=server.url + "/v1", api_key="-")...
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from runner.errors import ServerError
from runner.infer.config.architecture import compiled_refusal
from runner.infer.serve.compiled_slots import CompiledSlots
from runner.infer.serve.live import SchedulerConfig
from runner.infer.serve.scheduler import Scheduler
from runner.infer.server.app import ServerState, create_app
from runner.infer.server.engine_loop import EngineLoop
from runner.infer.server.prometheus import ServerMetrics

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


def make_scheduler(model, tokenizer, config: SchedulerConfig, engine: str = "eager", columns: int = 512,
                   draft=None) -> Scheduler:
    """Our continuous batching on `engine`: eager (each request its own cache; `draft`: a draft model proposes
    spec_k tokens a step) or compiled (`columns`: the most tokens one request may hold; its one shape compiles
    here, before the server listens)."""
    if engine == "compiled":
        if reason := compiled_refusal(model.config):
            raise ServerError(f"engine compiled cannot serve this model: {reason}")
        return CompiledSlots(model, config, tokenizer=tokenizer, columns=columns)
    return Scheduler(model, config, tokenizer=tokenizer, draft=draft)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: a free port); a taken or refused address is a ServerError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = ("is already in use (another server? choose another with --port)" if exc.errno == errno.EADDRINUSE
               else f"cannot be bound: {exc.strerror or exc}")
        raise ServerError(f"address {host}:{port} {why}") from None
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """One server: `start`, then `drain` / `cancel_running` / `stop`. `url` is http://host:port."""

    def __init__(self, scheduler: Scheduler, tokenizer, model_name: str, sock: socket.socket,
                 max_seq_len: int | None = None):
        model = scheduler.model
        self.sock = sock
        self.metrics = ServerMetrics()
        self.engine = EngineLoop(scheduler, self.metrics)
        context = max_seq_len or scheduler.config.sampling.max_seq_len
        spec = scheduler.pool.spec
        most = min(context, max(0, scheduler.pool.total - spec.reserve) * spec.block_size,
                   getattr(scheduler, "columns", context))  # what Scheduler.submit (and CompiledSlots') would take
        self.state = ServerState(self.engine, tokenizer, model_name, context,
                                 int(model.get_input_embeddings().num_embeddings), most)
        config = uvicorn.Config(create_app(self.state), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self.uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, name="runner-http",
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self.engine.start()
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.engine.close()
                raise ServerError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        log.info("serving %s at %s", self.state.model_name, self.url)

    def drain(self) -> None:
        """Accept nothing new (503 with Retry-After); what was accepted runs to its end."""
        self.state.draining = True

    @property
    def idle(self) -> bool:
        return self.state.idle

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no request is in flight; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.state.idle:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def cancel_running(self) -> None:
        """Every accepted request finishes "cancelled" now (streams end with that finish_reason)."""
        self.state.draining = True
        self.engine.cancel_all()

    def stop(self) -> None:
        """Close the listener, then the engine thread (anything still open finishes "cancelled")."""
        self.uvicorn.should_exit = True
        if self._thread.is_alive():
            self._thread.join(10)
        self.engine.close()
        self.sock.close()


@contextmanager
def serving(model, tokenizer, config: SchedulerConfig | None = None, *, engine: str = "eager", columns: int = 512,
            model_name: str = "model", host: str = "127.0.0.1", port: int = 0,
            max_seq_len: int | None = None) -> Iterator[HttpServer]:
    """The server in this process on host:port (default: loopback, a free port) for as long as the block runs;
    `server.url` is its base URL. Tests and benchmarks use this; `run serve` goes through the same class."""
    sock = bind(host, port)
    try:
        scheduler = make_scheduler(model, tokenizer, config or SchedulerConfig(), engine, columns)
    except BaseException:
        sock.close()
        raise
    server = HttpServer(scheduler, tokenizer, model_name, sock, max_seq_len)
    server.start()
    try:
        yield server
    finally:
        server.stop()
