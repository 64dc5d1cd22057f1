"""The FastAPI routes of the OpenAI-compatible server: /v1/completions and /v1/chat/completions (streamed as
server-sent events or whole), /v1/models, /health, /metrics. Each generation request becomes a serve `Request`
(with its own sampling) handed to the engine thread (engine_loop.py); its events come back on an asyncio queue.

Statuses: a body that does not validate (malformed JSON included) is 400 with the field named in OpenAI's error
shape (`param`), never FastAPI's 422; an unknown model 404; a prompt that does not fit the context or the KV budget
400; a full waiting queue 429 and a draining server 503, both with Retry-After. A client that goes away (a stream
whose send fails, a whole response whose connection closes) has its request cancelled at once: its slot and blocks
are freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from runner.infer.config.decoding import GenerateConfig
from runner.infer.serve.requests import Request as ServeRequest
from runner.infer.server import protocol as p
from runner.infer.server.engine_loop import EngineLoop, Event

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # Retry-After of a 429 (queue full) or 503 (draining)
DISCONNECT_POLL_S = 0.2  # a whole (not streamed) response checks this often whether its client is still there


@dataclass
class ServerState:
    """What the routes share. `pending` counts handlers between their checks and the engine's first answer (a
    drain waits for them and for the engine's open requests)."""

    engine: EngineLoop
    tokenizer: Any  # a transformers tokenizer
    model_name: str
    max_seq_len: int  # the model's context
    vocab_size: int
    max_request_tokens: int  # the most prompt + output tokens one request may hold: the context, the whole KV
    # budget, the compiled slots' columns, whichever is least (`max_model_len` in /v1/models)
    draining: bool = False
    pending: int = 0

    @property
    def idle(self) -> bool:
        return self.pending == 0 and self.engine.in_flight == 0


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="runner", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = state.engine.metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected("invalid")
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            return _error(400, f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}")
        loc = [str(part) for part in error["loc"][1:] if "[" not in str(part)]  # leave out union members' tags
        param = ".".join(loc) or None
        message = str(error["msg"]).removeprefix("Value error, ")
        return _error(400, f"{param}: {message}" if param else message, param=param)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404 else None)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return _error(503, "draining: finishing the requests in flight, accepting none", retry=True)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "runner",
                 "max_model_len": state.max_request_tokens}
        return JSONResponse({"object": "list", "data": [model]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, http: Request) -> Response:
        prompt = body.prompt
        if isinstance(prompt, str):
            ids = p.text_prompt_ids(state.tokenizer, prompt)
        else:
            ids = list(prompt)  # type: ignore[arg-type]
            if bad := [i for i in ids if not 0 <= i < state.vocab_size]:
                return _reject(state, 400, f"prompt: token id {bad[0]} is outside the vocabulary "
                                           f"[0, {state.vocab_size})", "invalid", param="prompt")
        return await _generate(state, http, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatRequest, http: Request) -> Response:
        try:
            ids = p.chat_prompt_ids(state.tokenizer, [(m.role, m.text) for m in body.messages])
        except Exception as exc:  # the model's chat template refused them (a role it has no place for, ...)
            return _reject(state, 400, f"messages: the model's chat template refused them: {exc}", "invalid",
                           param="messages")
        return await _generate(state, http, body, ids, chat=True)

    return app


async def _generate(state: ServerState, http: Request, body: p.Sampling, ids: list[int], chat: bool) -> Response:
    """Checks, then the request to the engine; a refusal, a whole response or a stream."""
    if body.model != state.model_name:
        return _reject(state, 404, f"the model `{body.model}` does not exist; this server serves "
                                   f"`{state.model_name}` (GET /v1/models)", "unknown_model", param="model",
                       code="model_not_found", kind="not_found_error")
    if state.draining:
        return _reject(state, 503, "the server is draining (shutting down): it accepts no new requests",
                       "draining", retry=True)
    prompt_field = "messages" if chat else "prompt"
    limit = state.max_request_tokens
    room = limit - len(ids)
    if room < 1:
        return _reject(state, 400, f"{prompt_field}: {len(ids)} tokens; a request holds at most {limit} tokens, prompt "
                                   f"and output together ({_limits(state)})", "invalid", param=prompt_field)
    max_tokens = body.max_tokens or (room if chat else min(p.DEFAULT_COMPLETION_TOKENS, room))
    if max_tokens > room:
        return _reject(state, 400, f"max_tokens: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed the "
                                   f"{limit} tokens a request may hold ({_limits(state)})", "invalid",
                       param="max_tokens")
    try:
        sampling = GenerateConfig(temperature=body.temperature, top_p=body.top_p if body.top_p < 1 else None,
                                  seed=body.seed, stop_strings=body.stops, max_seq_len=state.max_seq_len)
    except ValidationError as exc:  # a value our sampler refuses that the wire format let through
        error = exc.errors()[0]
        field = {"stop_strings": "stop"}.get(str(error["loc"][0]), str(error["loc"][0])) if error["loc"] else None
        return _reject(state, 400, f"{field}: {error['msg']}", "invalid", param=field)
    minimum = max_tokens if body.ignore_eos else min(body.min_tokens, max_tokens)
    engine = state.engine
    events: asyncio.Queue[Event] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    rid = engine.new_id()
    request = ServeRequest(rid, engine.now(), tuple(ids), max_tokens, minimum, sampling=sampling)
    state.pending += 1
    try:
        def sink(event: Event) -> None:  # on the engine thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        engine.submit(request, sink)
        first = await events.get()
    finally:
        state.pending -= 1
    if first.code == 429:
        return _error(429, f"the waiting queue is full: {first.error}; retry later", retry=True,
                      code="queue_full", kind="rate_limit_error")
    if first.code != 200:
        return _error(first.code, f"{prompt_field}: {first.error}", param=prompt_field)
    name = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
    text = p.Detokenizer(state.tokenizer, body.stops)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _chunks(events, text, name, state.model_name, len(ids), chat, usage, body.return_token_ids)
        return _Stream(stream, lambda: engine.cancel(rid), media_type="text/event-stream")
    last = await _until_finished(events, http, lambda: engine.cancel(rid))
    if last is None:  # the client went away
        return Response(status_code=499)
    record = last.record
    assert record is not None
    if last.finish == "cancelled":
        return _error(503, "cancelled: the server is shutting down", retry=True)
    if last.code != 200:
        return _error(last.code, last.error, kind="server_error")
    out = state.tokenizer.decode(record.output_ids, skip_special_tokens=True)
    if last.finish == "stop":
        out = p.cut_at_stop(out, body.stops)
    make = p.chat_body if chat else p.completion_body
    return JSONResponse(make(name, state.model_name, out, p.finish_reason(last.finish), len(ids),
                             len(record.output_ids), token_ids=record.output_ids if body.return_token_ids else None))


async def _until_finished(events: asyncio.Queue[Event], http: Request, cancel: Callable[[], None]) -> Event | None:
    """The request's last event; None, and the request cancelled, when its client disconnects first (checked every
    DISCONNECT_POLL_S, tokens arriving or not)."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            try:
                event: Event | None = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if event is not None and event.finish:
                return event
            if loop.time() >= check_at:
                check_at = loop.time() + DISCONNECT_POLL_S
                if await http.is_disconnected():
                    cancel()
                    return None
    except asyncio.CancelledError:
        cancel()
        raise


async def _chunks(events: asyncio.Queue[Event], text: p.Detokenizer, name: str, model: str, prompt_tokens: int,
                  chat: bool, usage: bool, token_ids: bool = False) -> AsyncIterator[str]:
    """The server-sent events of one request: text deltas (with the tokens they came from, when asked), the finish,
    the usage when asked, then [DONE]. A token whose text is held back (part of a character, a possible stop
    string) goes out with the next chunk."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        yield _sse(p.chat_chunk(name, model, {"role": "assistant", "content": ""}, None))
    held: list[int] = []
    while True:
        event = await events.get()
        final = bool(event.finish)
        held += event.tokens
        delta = text.add(event.tokens, final=final, stopped=event.finish == "stop")
        if delta or final:
            reason = p.finish_reason(event.finish) if final else None
            if event.code != 200:
                yield _sse(p.error_body(event.error, "server_error"))
                break
            ids, held = (held if token_ids else None), []
            yield _sse(p.chat_chunk(name, model, {"content": delta} if delta else {}, reason, ids) if chat
                       else p.completion_body(name, model, delta, reason, prompt_tokens, 0, chunk=True,
                                              token_ids=ids))
        if final:
            if usage and event.record is not None:
                yield _sse(p.usage_chunk(name, model, obj, prompt_tokens, len(event.record.output_ids)))
            break
    yield "data: [DONE]\n\n"


class _Stream(StreamingResponse):
    """A stream that, however it ends (finished, its client gone, the server stopping), closes its generator and
    cancels its request (a no-op when the request already finished)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _limits(state: ServerState) -> str:
    if state.max_request_tokens == state.max_seq_len:
        return "the model's context"
    return f"the model's context is {state.max_seq_len}; the KV budget or the compiled slots hold fewer"


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _reject(state: ServerState, status: int, message: str, outcome: str, param: str | None = None,
            code: str | None = None, kind: str | None = None, retry: bool = False) -> JSONResponse:
    state.engine.metrics.rejected(outcome)
    return _error(status, message, param=param, code=code, kind=kind, retry=retry)


def _error(status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None,
           retry: bool = False) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
    return JSONResponse(p.error_body(message, kind, param, code), status_code=status, headers=headers)
