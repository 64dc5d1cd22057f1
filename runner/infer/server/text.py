"""Text in and out of the server: prompts to token ids (a chat through the tokenizer's chat template, or a plain
join when it has none), and output ids back to text as they stream, cut at a stop string.

The plain join, for a tokenizer without a chat template: each message as `role: content` on its own line, then
`assistant:` for the reply to follow, e.g. "system: Be brief.\\nuser: Hi\\nassistant:".
"""

from __future__ import annotations

from collections.abc import Sequence


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
