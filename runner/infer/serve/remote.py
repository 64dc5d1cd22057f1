"""Any OpenAI-compatible server as a server the driver feeds: our own (`run serve`), llama.cpp's
(`python -m llama_cpp.server`), vLLM's. The same seeded load, the same latencies from each request's scheduled
arrival, one table with the in-process systems.

Each request is one streaming POST (`/v1/completions`, or `/v1/chat/completions` with the prompt as one user
message) on a thread of a pool, so requests are in flight together as their arrivals say; the driver sleeps until
the next arrival or the next finish (`wait`), so it takes no CPU from a server on the same machine. Sent as text
(the load's token ids decoded by the load's tokenizer) or as token ids (`prompt_format: token_ids`, for a server
with the same vocabulary).

What is counted through the server's own tokenizer: `usage.prompt_tokens` (kept per request as `server_prompt_tokens`:
a server whose tokenizer or BOS differs shows it there; a stream without usage, as llama.cpp's servers send, has its
prompts counted by the server's tokenize endpoint after the load) and `usage.completion_tokens` (the output length;
without usage, `max_tokens` when it stopped for length, else one token per chunk). A token's time is when its chunk
arrived (a chunk with empty text before the last is a token that ends mid-character); a chunk carrying several
tokens gives them all its time (tokens past the chunks, when the count says more, take the last chunk's time).
Exact output lengths: `min_tokens` and `ignore_eos` are sent (vLLM's and runner's extensions); a server that ignores
them stops at EOS, unless `suppress_eos` adds a logit bias of -100 on the load tokenizer's EOS ids (same vocabulary
only). The output's ids are the server's own when it returns them (`return_token_ids`, asked for with
`prompt_format: token_ids`: vLLM and our server), else the load tokenizer's encoding of the returned text
(multi-turn loads build the next prompt from them).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from runner.errors import StepError
from runner.infer.serve.requests import Request, RequestRecord

log = logging.getLogger(__name__)

MAX_WAIT_S = 1.0  # longest the driver sleeps in `wait` without looking
TOKENIZE_PATHS = ("/tokenize", "/extras/tokenize")  # vLLM's and llama.cpp's own server; llama-cpp-python's server
READY_POLL_S = 0.25


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: its base URL (`http://host:port`, with or without `/v1`) and the model name it
    serves."""

    name: str
    url: str
    model: str
    api: str = "completions"  # or "chat"
    prompt_format: str = "text"  # or "token_ids"
    suppress_eos: bool = False
    timeout_s: float = 600.0

    @property
    def base(self) -> str:
        return self.root + "/v1"

    @property
    def root(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


class RemoteServer:
    """Requests sent to an Endpoint as they arrive, each streamed back on a thread of its own."""

    def __init__(self, endpoint: Endpoint, tokenizer, max_in_flight: int = 256, seed: int | None = None):
        self.endpoint, self.tokenizer, self.seed = endpoint, tokenizer, seed
        self.clock = time.perf_counter
        self._client = httpx.Client(timeout=endpoint.timeout_s,
                                    limits=httpx.Limits(max_connections=max_in_flight,
                                                        max_keepalive_connections=max_in_flight))
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix=f"remote-{endpoint.name}")
        self._open: dict[int, RequestRecord] = {}
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self.server_prompt_tokens: dict[int, int] = {}  # request id → the server's count of its prompt tokens
        self._texts: dict[int, str] = {}  # request id → the prompt sent as text

    def submit(self, request: Request) -> RequestRecord:
        record = RequestRecord(request.id, request.arrival_s, len(request.prompt_ids))
        with self._lock:
            self._open[request.id] = record
        self._pool.submit(self._send, request, record)
        return record

    @property
    def wake_s(self) -> float | None:
        """Due now when a request finished since the last step, else never: the driver sleeps (in `wait`) until
        its next arrival or the next finish, whichever comes first, and never spins."""
        return None if self._finished.is_set() else math.inf

    def step(self) -> None:
        self._finished.clear()

    def wait(self, seconds: float) -> None:
        """The driver's sleep: over at `seconds`, or as soon as a request finishes."""
        self._finished.wait(min(seconds, MAX_WAIT_S))

    @property
    def busy(self) -> bool:
        with self._lock:
            for rid in [rid for rid, record in self._open.items() if record.finish]:
                del self._open[rid]
            return bool(self._open)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def body(self, request: Request) -> dict:
        """The JSON body of one request (greedy; exact output lengths asked for as the module says)."""
        ep = self.endpoint
        prompt: str | list[int] = (list(request.prompt_ids) if ep.prompt_format == "token_ids"
                                   else self.tokenizer.decode(list(request.prompt_ids)))
        if isinstance(prompt, str):
            self._texts[request.id] = prompt
        body: dict = {"model": ep.model, "max_tokens": request.max_new_tokens, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.seed is not None:
            body["seed"] = self.seed
        if ep.prompt_format == "token_ids":  # same vocabulary: the output's ids too (vLLM's and our server's field)
            body["return_token_ids"] = True
        body |= ({"messages": [{"role": "user", "content": prompt}]} if ep.api == "chat" else {"prompt": prompt})
        if request.min_new_tokens:
            body |= {"min_tokens": request.min_new_tokens,
                     "ignore_eos": request.min_new_tokens >= request.max_new_tokens}
            if ep.suppress_eos:
                body["logit_bias"] = {str(i): -100 for i in _eos_ids(self.tokenizer)}
        return body

    def count_prompt_tokens(self) -> None:
        """Prompts whose stream carried no usage (llama.cpp's servers send none), counted by the server's tokenize
        endpoint after the load, outside its timing; a server with none leaves them unchecked."""
        ep = self.endpoint
        for rid, text in self._texts.items():
            if rid in self.server_prompt_tokens:
                continue
            for path in TOKENIZE_PATHS:  # one body that each server's schema reads its own field from
                try:
                    response = httpx.post(ep.root + path, timeout=30,
                                          json={"model": ep.model, "prompt": text, "content": text, "input": text})
                    if response.status_code == 200 and isinstance(tokens := response.json().get("tokens"), list):
                        self.server_prompt_tokens[rid] = len(tokens)
                        break
                except (httpx.HTTPError, ValueError):
                    continue

    def _send(self, request: Request, record: RequestRecord) -> None:
        ep, path = self.endpoint, "/chat/completions" if self.endpoint.api == "chat" else "/completions"
        text: list[str] = []
        times: list[float] = []
        usage: dict = {}
        ids: list[int] = []
        reason = ""
        try:
            with self._client.stream("POST", ep.base + path, json=self.body(request)) as response:
                if response.status_code != 200:
                    response.read()
                    record.finish = "refused" if response.status_code in (429, 503) else "error"
                    record.error = f"HTTP {response.status_code}: {_message(response.text)}"
                    return
                for data in _events(response.iter_lines()):
                    chunk = json.loads(data)
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") if ep.api == "chat" else choice.get("text")
                        finish, chunk_ids = choice.get("finish_reason"), choice.get("token_ids")
                        if isinstance(chunk_ids, list):  # the server said which tokens (return_token_ids)
                            now = self.clock()
                            times += [now] * len(chunk_ids)
                            ids += chunk_ids
                        elif piece or (piece == "" and not finish):  # an empty piece: a token ending mid-character
                            times.append(self.clock())
                        text.append(piece or "")
                        reason = finish or reason
            record.output_ids = ids or list(self.tokenizer.encode("".join(text), add_special_tokens=False))
            count = (len(ids) if ids else int(usage["completion_tokens"]) if "completion_tokens" in usage
                     else request.max_new_tokens if reason == "length" else len(times))
            record.token_s = times[:count] + times[-1:] * max(0, count - len(times)) if times else []
            if "prompt_tokens" in usage:
                self.server_prompt_tokens[request.id] = int(usage["prompt_tokens"])
            record.finish = {"stop": "stop", "length": "length"}.get(reason, "eos" if reason else "length")
        except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
            record.finish, record.error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self._finished.set()


def _events(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event up to `[DONE]`."""
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            if data:
                yield data


def _message(body: str) -> str:
    try:
        error = json.loads(body).get("error", body)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
    except (ValueError, AttributeError):
        return body[:300]


def _eos_ids(tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [int(eos)]


def served_models(url: str, timeout_s: float = 5.0) -> list[str]:
    """The model names an OpenAI-compatible server lists at /v1/models (raises httpx.HTTPError when it does not
    answer)."""
    response = httpx.get(Endpoint("", url, "").base + "/models", timeout=timeout_s)
    response.raise_for_status()
    return [m.get("id", "") for m in response.json().get("data", [])]


@contextmanager
def launched(command: Sequence[str], endpoint: Endpoint, log_path: Path, timeout_s: float) -> Iterator[None]:
    """Start a server's `command`, wait until `endpoint` lists its model, and stop it on leaving (SIGINT, then
    SIGKILL after 10 s). Its output goes to `log_path`; a server that exits or does not answer in `timeout_s` is a
    StepError quoting the end of that log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        try:
            proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise StepError(f"endpoint {endpoint.name}: cannot start {command[0]!r}: {exc.strerror or exc}") from None
    try:
        _wait_ready(proc, endpoint, log_path, timeout_s)
        yield
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen, endpoint: Endpoint, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StepError(f"endpoint {endpoint.name}: its server exited ({proc.returncode}) before answering; "
                            f"the end of {log_path}:\n{_tail(log_path)}")
        try:
            models = served_models(endpoint.url)
        except httpx.HTTPError:
            time.sleep(READY_POLL_S)
            continue
        if endpoint.model not in models:
            raise StepError(f"endpoint {endpoint.name}: {endpoint.url} serves {models}, not model "
                            f"{endpoint.model!r}: set model to one of them")
        return
    raise StepError(f"endpoint {endpoint.name}: no answer at {endpoint.url} within {timeout_s:g} s; the end of "
                    f"{log_path}:\n{_tail(log_path)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
