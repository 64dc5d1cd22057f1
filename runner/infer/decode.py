"""Our prefill + decode loop over a transformers Cache: batches, streaming, stop rules, continuation.

The chain, in call order (shapes in comments):
    positions_for → forward_last (prefill) → next_token → decode_one_token → ... → finished_rows
`Generator` keeps the cache between calls, so a second `.generate()` continues the conversation.
Rows of a left-padded batch are independent: a finished row keeps being fed a masked pad token.
Does not know about manifests, tracking or printing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from runner.errors import StepError
from runner.infer.config import GenerateConfig
from runner.infer.kvcache import make_cache
from runner.infer.sampling import next_token


@dataclass
class DecodeStats:
    """Timing and stop reasons of the last call; seconds are wall-clock after device sync."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0  # real (unpadded) tokens prefilled, summed over rows
    new_tokens: list[int] = field(default_factory=list)  # per row, EOS included
    stop_reasons: list[str] = field(default_factory=list)  # per row: eos, stop_string, max_new_tokens, max_seq_len

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(self.new_tokens, default=0) - 1  # the first token comes from the prefill
        return steps * len(self.new_tokens) / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0


def positions_for(past_mask: torch.Tensor | None, new_mask: torch.Tensor) -> torch.Tensor:
    """Position of each new token = real tokens before it in its row. [B,P], [B,T] → [B,T]."""
    before = past_mask.sum(-1, keepdim=True) if past_mask is not None else 0
    return (before + new_mask.cumsum(-1) - 1).clamp(min=0)


def forward_last(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """Run `ids` through the model into `cache`; logits of the last position. [B,T] → [B,V]."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :]


def decode_one_token(model, token: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """[B] token, full mask [B,P+1], positions [B] → [B,V] logits."""
    return forward_last(model, token[:, None], mask, positions[:, None], cache)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Generator:
    """Stateful generation with the seed API: `.generate()`, `.generate_iter()`, `.reset()`."""

    def __init__(self, model, config: GenerateConfig | None = None, device=None, tokenizer=None,
                 generator: torch.Generator | None = None):
        self.config = config or GenerateConfig()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer  # needed only for stop_strings
        if (self.config.stop_strings or self.config.cache_kind == "auto") and tokenizer is None:
            raise ValueError("stop_strings and cache_kind='auto' need a tokenizer: Generator(..., tokenizer=tok)")
        self.selection = None  # what cache_kind='auto' chose for the last call's batch size
        self._selections: dict = {}  # batch size → Selection: the budget depends on the batch
        self.rng = generator or torch.Generator(self.device).manual_seed(self.config.seed or 0)
        self.eos_ids = self._eos_ids()
        self.stats = DecodeStats()
        self.reset()

    def reset(self) -> None:
        """Forget the conversation: the next call starts from an empty cache."""
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B,P] mask of what is in the cache
        self.sequence: torch.Tensor | None = None  # [B,P+1] every token so far (repetition penalty)
        self.pending: torch.Tensor | None = None  # [B] last sampled token, not yet in the cache

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B,T] prompt (left-padded) → [B,T+N]: the prompt then this turn's tokens (pad after a row stops)."""
        new = torch.stack(list(self.steps(input_ids, attention_mask)), dim=1)  # max_new_tokens ≥ 1
        return torch.cat([input_ids.to(self.device), new], dim=1)

    def generate_iter(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Iterator[int]:
        """Yield token ids one at a time as they are decided (batch of one)."""
        if input_ids.shape[0] != 1:
            raise ValueError("generate_iter streams one sequence; use generate() or steps() for a batch")
        for token in self.steps(input_ids, attention_mask):
            yield int(token[0])

    @torch.inference_mode()
    def steps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """Yield [B] tokens per step; finished rows yield the pad id. Fills `self.stats`."""
        cfg, model = self.config, self.model
        ids = input_ids.to(self.device)
        new_mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).to(self.device)
        if self.pending is not None:  # continue: the last token of the previous turn enters the cache first
            ids = torch.cat([self.pending[:, None], ids], dim=1)
            new_mask = torch.cat([torch.ones_like(self.pending[:, None]), new_mask], dim=1)
        if self.cache is None:
            self.cache = make_cache(self._cache_kind(ids.shape[0]), model)
        past_len = self.mask.shape[1] if self.mask is not None else 0
        if past_len + ids.shape[1] >= cfg.max_seq_len:
            raise StepError(f"prompt of {past_len + ids.shape[1]} tokens does not fit max_seq_len={cfg.max_seq_len}")
        batch = ids.shape[0]
        self.stats = DecodeStats(prompt_tokens=int(new_mask.sum()), new_tokens=[0] * batch, stop_reasons=[""] * batch)

        start = time.perf_counter()
        positions = positions_for(self.mask, new_mask)
        self.mask = new_mask if self.mask is None else torch.cat([self.mask, new_mask], dim=1)
        logits = forward_last(model, ids, self.mask, positions, self.cache)
        self.sequence = ids if self.sequence is None else torch.cat([self.sequence, ids], dim=1)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        pad = torch.full((batch,), self._pad_id(), dtype=torch.long, device=self.device)
        for step in range(cfg.max_new_tokens):
            token = torch.where(done, pad, next_token(logits, self.sequence, cfg, self.rng))
            if step == 0:
                sync(self.device)
                self.stats.prefill_s = time.perf_counter() - start
                start = time.perf_counter()
            self.sequence = torch.cat([self.sequence, token[:, None]], dim=1)
            self.pending = token
            newly_done = self._finished_rows(token, done, step)
            done = done | newly_done
            yield token
            if bool(done.all()):
                break
            live = (~done).long()[:, None]  # finished rows feed a masked pad: their output is final
            positions = self.mask.sum(-1)
            self.mask = torch.cat([self.mask, live], dim=1)
            logits = decode_one_token(model, token, self.mask, positions, self.cache)
        sync(self.device)
        self.stats.decode_s = time.perf_counter() - start

    def _cache_kind(self, batch: int) -> str | None:
        if self.config.cache_kind != "auto":
            return self.config.cache_kind
        if batch not in self._selections:
            from runner.infer.autocache import select_cache_kind

            self._selections[batch] = select_cache_kind(self.model, self.tokenizer, self.config, batch_size=batch)
        self.selection = self._selections[batch]
        return self.selection.kind

    def _finished_rows(self, token: torch.Tensor, done: torch.Tensor, step: int) -> torch.Tensor:
        """[B] bool: rows that stop after this token; records how many tokens each row made and why."""
        finished = torch.zeros_like(done)
        full = self.mask.shape[1] + 1 >= self.config.max_seq_len
        for row in range(token.shape[0]):
            if done[row]:
                continue
            self.stats.new_tokens[row] = step + 1
            reason = ("eos" if int(token[row]) in self.eos_ids
                      else "stop_string" if self._hit_stop_string(row, step + 1)
                      else "max_new_tokens" if step + 1 == self.config.max_new_tokens
                      else "max_seq_len" if full else "")
            if reason:
                self.stats.stop_reasons[row] = reason
                finished[row] = True
        return finished

    def _hit_stop_string(self, row: int, n_new: int) -> bool:
        stops = self.config.stop_strings
        if not stops:
            return False
        tail = max(len(s) for s in stops) + 8  # tokens: enough to hold the longest stop string
        text = self.tokenizer.decode(self.sequence[row, -min(n_new, tail):], skip_special_tokens=False)
        return any(s in text for s in stops)

    def _eos_ids(self) -> set[int]:
        eos = self.config.eos_token_id
        if eos is None:
            eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def _pad_id(self) -> int:
        pad = getattr(getattr(self.model, "generation_config", None), "pad_token_id", None)
        if pad is None and self.tokenizer is not None:
            pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else min(self.eos_ids, default=0))


def generate(model, input_ids: torch.Tensor, config: GenerateConfig | None = None,
             attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
             tokenizer=None, **settings) -> torch.Tensor:
    """Stateless: `generate(model, ids, max_new_tokens=64, temperature=0.8)` → [B,T+N] token ids."""
    base = config.model_dump(exclude_unset=True) if config is not None else {}
    config = GenerateConfig.model_validate({**base, **settings})
    return Generator(model, config=config, tokenizer=tokenizer, generator=generator).generate(input_ids, attention_mask)
