"""The OpenAI-compatible wire format: request bodies as pydantic models, the response and chunk bodies, the error
shape. Torch-free; knows nothing of the scheduler.

Policy on fields: a field OpenAI defines that we do not act on (user, logit_bias, ...) or that we have never heard of
is ignored, as vLLM does, so clients that send them work; a field we know but cannot honour with a non-default value
(n > 1, logprobs, echo, best_of > 1, tools, response_format, penalties ≠ 0) is refused with 400 naming the field, so
a client never gets silently different output. Extensions as vLLM's: `ignore_eos` (EOS is an ordinary token until
max_tokens, for exact output lengths) and `min_tokens` (EOS ignored until this many).

Text in and out: prompts to token ids (a chat through the tokenizer's chat template; without one, a plain join: each
message as `role: content` on its own line, then `assistant:` for the reply, e.g. "user: Hi\nassistant:"), and
output ids back to text as they stream, cut at a stop string.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints share: limits, sampling, stop, streaming, and the fields refused when set."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=10_000_000)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's range and default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=10_000_000)
    return_token_ids: bool = False  # vLLM's: each choice (each streamed chunk's) carries its output token ids
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: 0 only")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: 0 only")
    logprobs: Any = None
    tools: Any = None
    response_format: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return value

    @field_validator("logprobs", "tools", "response_format")
    @classmethod
    def _refused(cls, value: Any) -> Any:
        if value not in (None, False):
            raise ValueError("not supported by this server")
        return value

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(Sampling):
    """/v1/completions: one prompt, as text or as token ids (load generators send exact ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = Field(False, description="not supported: false only")
    best_of: int = Field(1, ge=1, le=1, description="not supported: 1 only")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("one prompt per request (send a list of prompts as separate requests)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported by this server")
        return value


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None

    @property
    def text(self) -> str:
        """The content as text: a list of parts keeps its text parts (images and audio are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatRequest(Sampling):
    """/v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)

    @field_validator("messages")
    @classmethod
    def _text_only(cls, messages: list[Message]) -> list[Message]:
        for message in messages:
            message.text  # noqa: B018 (raises on a non-text part: a 400 naming messages)
        return messages


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, prompt_tokens: int, completion_tokens: int,
                    chunk: bool = False, token_ids: list[int] | None = None) -> dict:
    body: dict = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                  "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if token_ids is not None:
        body["choices"][0]["token_ids"] = token_ids
    if not chunk:
        body["usage"] = usage(prompt_tokens, completion_tokens)
    return body


def chat_body(rid: str, model: str, text: str, finish: str | None, prompt_tokens: int, completion_tokens: int,
              token_ids: list[int] | None = None) -> dict:
    choice: dict = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None, token_ids: list[int] | None = None) -> dict:
    choice: dict = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [choice]}


def usage_chunk(rid: str, model: str, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk with stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(finish: str) -> str:
    """The scheduler's finish → OpenAI's finish_reason (eos and stop strings are both `stop`)."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(finish, finish)


def chat_prompt_ids(tokenizer, messages: Sequence[tuple[str, str]]) -> list[int]:
    """(role, text) messages → the prompt's token ids, as the model was tuned to read them when it can tell."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": role, "content": text} for role, text in messages],
                                            add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)
    return text_prompt_ids(tokenizer, plain_chat(messages))


def plain_chat(messages: Sequence[tuple[str, str]]) -> str:
    return "".join(f"{role}: {text}\n" for role, text in messages) + "assistant:"


def text_prompt_ids(tokenizer, text: str) -> list[int]:
    """A text prompt's ids, with the tokenizer's special tokens (a BOS where it adds one), as vLLM encodes."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first stop string (left out, as OpenAI does); whole when none occurs."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(ends)] if ends else text


class Detokenizer:
    """Output ids → text deltas. Each `add` decodes the whole output (so multi-token characters and merges come out
    right) and returns only text that cannot change any more: an incomplete UTF-8 character ("\\ufffd" at the end)
    and the last len(longest stop) − 1 characters (they may begin a stop string) wait for the next tokens or the end.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.ids: list[int] = []
        self.sent = 0  # characters already returned
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def add(self, tokens: Sequence[int], final: bool = False, stopped: bool = False) -> str:
        """The new text after `tokens`; `final`: the request finished (everything left comes out, cut at the stop
        string when `stopped`)."""
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if final:
            end = len(cut_at_stop(text, self.stops)) if stopped else len(text)
        else:
            end = len(text.rstrip("\ufffd")) - self.hold
            cut = cut_at_stop(text, self.stops)
            end = min(end, len(cut))
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out
