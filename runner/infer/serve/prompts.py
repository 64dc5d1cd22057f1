"""The token content of a load's requests: prompts of exactly the asked number of token ids, cut from a real text or
taken from a prompts file. Torch-free.

Exact counts come from cutting token ids, never from decoding and re-encoding text (which changes counts at the
seams). Any tokenizer with `encode(text, add_special_tokens=False)` and `decode(ids)` serves (tests use a byte-level
one); the ids returned hold no special tokens (a scheduler that wants a BOS adds it, and counts it).
"""

from __future__ import annotations

import json
import random
from typing import Protocol

from runner.errors import DataError

POOL_TOKENS = 65_536  # tokens of the text kept as the pool synthetic prompts are cut from
CHARS_PER_TOKEN = 8  # generous: the text cut before encoding is POOL_TOKENS × this many characters


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def encode(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


class TokenPool:
    """The token ids of a real text, encoded once; a synthetic prompt is a span of it at an offset the data seed draws
    (wrapping round at the end, so a short text still gives prompts of any length)."""

    def __init__(self, tokenizer: Tokenizer, text: str, name: str = "text", max_tokens: int = POOL_TOKENS):
        cut = text[:max_tokens * CHARS_PER_TOKEN]
        self.ids = encode(tokenizer, cut)[:max_tokens]
        if not self.ids:
            raise DataError(f"{name} holds no tokens to cut prompts from")

    def span(self, rng: random.Random, n: int) -> tuple[int, ...]:
        """`n` token ids from an offset drawn from `rng` (one draw, whatever `n`)."""
        start = rng.randrange(len(self.ids))
        out: list[int] = []
        while len(out) < n:
            out += self.ids[start:start + n - len(out)]
            start = 0
        return tuple(out)


class PromptFile:
    """A prompts file's prompts, each encoded once when first used; prompt i of a load is line i modulo their number."""

    def __init__(self, tokenizer: Tokenizer, prompts: list[str], name: str = "prompts file"):
        if not prompts:
            raise DataError(f"{name} holds no prompts")
        self.tokenizer, self.prompts, self.name = tokenizer, prompts, name
        self._ids: dict[int, tuple[int, ...]] = {}

    def take(self, index: int, n: int | None) -> tuple[int, ...]:
        """The first `n` tokens of prompt `index` (modulo), or all of it for None; DataError when it is shorter."""
        i = index % len(self.prompts)
        if i not in self._ids:
            self._ids[i] = encode(self.tokenizer, self.prompts[i])
        ids = self._ids[i]
        if n is not None and len(ids) < n:
            raise DataError(f"{self.name}: prompt {i + 1} has {len(ids)} tokens, fewer than the {n} asked for a "
                            f"request: lower prompt_tokens, or use longer prompts")
        if not ids:
            raise DataError(f"{self.name}: prompt {i + 1} holds no tokens")
        return ids if n is None else ids[:n]


def prompt_lines(text: str, jsonl: bool) -> list[tuple[int, str]]:
    """(line number, prompt) of a prompts file's text: a .txt file's non-blank lines, or a .jsonl file's "prompt"
    values; ValueError names a bad line."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            out.append((number, line))
            continue
        try:
            out.append((number, str(json.loads(line)["prompt"])))
        except (ValueError, KeyError, TypeError, IndexError):
            raise ValueError(f'line {number}: expected a JSON object with a "prompt" key') from None
    return out


def short_prompt(lines: list[tuple[int, str]], need_tokens: int) -> str | None:
    """Why a prompts file cannot give prompts of `need_tokens` tokens, judged without a tokenizer (at `run check`):
    a token of a byte-level or SentencePiece tokenizer covers at least one byte, so a prompt of fewer UTF-8 bytes
    than `need_tokens` cannot hold them. None when every prompt may (the exact count is checked at run time)."""
    for number, prompt in lines:
        size = len(prompt.encode("utf-8"))
        if size < need_tokens:
            return (f"line {number}: the prompt is {size} bytes, too short for {need_tokens} tokens (a token is at "
                    f"least one byte): lower prompt_tokens, or use longer prompts")
    return None
