"""The forward chain everything else decodes and measures with: the bottom layer of runner.infer.

In call order (shapes in comments):
    positions_from → prefill (chunked when asked) → decode_one_token → ... ; sync before reading a clock.
`DecodeState` is what a conversation has fed so far (cache, mask, positions, length): strategies (contrastive,
beam) and generators change it only through its methods. `DecodeStateProtocol` is what every decode state offers
(`DecodeState` over a transformers cache; compiled.state.StaticDecodeState over a static one): a generator is
written against it. Special-token lookup (EOS, pad) lives here too.
Knows nothing of cache kinds (a cache is passed in; one whose layers evict slots says which through
`keep_columns`), sampling, timing or manifests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from transformers.cache_utils import Cache


def positions_from(count: torch.Tensor | None, new_mask: torch.Tensor) -> torch.Tensor:
    """Position of each new token = real tokens before it in its row. [B] count so far, [B,T] → [B,T]."""
    before = count[:, None] if count is not None else 0
    return (before + new_mask.cumsum(-1) - 1).clamp(min=0)


def positions_for(past_mask: torch.Tensor | None, new_mask: torch.Tensor) -> torch.Tensor:
    """As positions_from, counting the real tokens of `past_mask` [B,P]."""
    return positions_from(past_mask.sum(-1) if past_mask is not None else None, new_mask)


def trim_mask(mask: torch.Tensor, cache) -> torch.Tensor:
    """[B,n] mask of what was fed → the mask of what the cache still holds. Layers that evict slots (the sliding
    window) say which columns they keep through `keep_columns`; every other cache keeps them all."""
    layer = cache.layers[0] if getattr(cache, "layers", None) else None
    keep = getattr(layer, "keep_columns", None)
    return keep(mask) if keep is not None else mask


def forward(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
            hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `ids` [B,T] into `cache` → logits of the last position [B,V] and, if asked, the last layer's hidden
    states of every position [B,T,H]."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1, output_hidden_states=hidden)
    return out.logits[:, -1, :], out.hidden_states[-1] if hidden else None


def forward_tail(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
                 keep: int) -> torch.Tensor:
    """Run `ids` [B,T] into `cache` → logits of the last `keep` positions [B,keep,V] (a speculative verify)."""
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                 use_cache=True, logits_to_keep=keep).logits


def forward_last(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """Run `ids` through the model into `cache`; logits of the last position. [B,T] → [B,V]."""
    return forward(model, ids, mask, positions, cache)[0]


def decode_one_token(model, token: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """[B] token, full mask [B,P+1], positions [B] → [B,V] logits."""
    return forward_last(model, token[:, None], mask, positions[:, None], cache)


def prefill(model, ids: torch.Tensor, past_mask: torch.Tensor | None, new_mask: torch.Tensor,
            positions: torch.Tensor, cache, q_chunk: int | None = None, hidden: bool = False):
    """Feed the prompt [B,T] in chunks of `q_chunk` tokens (None = at once) → (last logits [B,V], the mask of what
    the cache now holds [B,n], hidden states [B,T,H] or None). Chunks bound the activations and attention scores
    to q_chunk rows; the logits equal the whole prefill's up to float rounding."""
    step = q_chunk or ids.shape[1]
    mask = past_mask
    states: list[torch.Tensor] = []  # hidden states of each chunk, when asked
    for start in range(0, ids.shape[1], step):
        part = slice(start, start + step)
        mask = new_mask[:, part] if mask is None else torch.cat([mask, new_mask[:, part]], dim=1)
        logits, h = forward(model, ids[:, part], mask, positions[:, part], cache, hidden)
        mask = trim_mask(mask, cache)
        if h is not None:
            states.append(h)
    return logits, mask, torch.cat(states, dim=1) if hidden else None


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it measures that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@runtime_checkable
class DecodeStateProtocol(Protocol):
    """A decode state: its cache and what was fed into it, changed only through `prefill` and `feed`."""

    @property
    def cache(self) -> Cache:
        """What the model writes K/V into: a transformers Cache, or a static cache (also a Cache)."""
        ...

    seen: torch.Tensor | None  # [B] real tokens fed so far: the next position
    length: int  # columns (tokens and pads) fed so far, for max_seq_len

    @property
    def mask(self) -> torch.Tensor | None:
        """[B,n] mask of what the cache holds."""
        ...

    def prefill(self, model, ids: torch.Tensor, new_mask: torch.Tensor, q_chunk: int | None = None,
                hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B,T] ids and their mask → (last logits [B,V], hidden states [B,T,H] or None)."""
        ...

    def feed(self, model, token: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """One decode step: [B] token (live [B] 0/1: finished rows feed a masked pad) → [B,V] logits."""
        ...


@dataclass
class DecodeState:
    """What a conversation has fed into its cache (a DecodeStateProtocol over a transformers cache; contrastive
    search's `feed_candidates` / `keep_candidate` too). Strategies and generators change it only through its methods."""

    cache: Cache  # a transformers Cache
    mask: torch.Tensor | None = None  # [B,n] mask of what the cache holds (n < length with a window)
    seen: torch.Tensor | None = None  # [B] real tokens fed so far: the next position
    length: int = 0  # columns (tokens and pads) fed so far, for max_seq_len
    candidate_mask: torch.Tensor | None = field(default=None, repr=False)  # [1,n+1] between feed/keep_candidate

    def prefill(self, model, ids: torch.Tensor, new_mask: torch.Tensor, q_chunk: int | None = None,
                hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B,T] ids and their mask → (last logits [B,V], hidden states [B,T,H] or None)."""
        positions = positions_from(self.seen, new_mask)
        self.seen = new_mask.sum(-1) if self.seen is None else self.seen + new_mask.sum(-1)
        self.length += ids.shape[1]
        logits, self.mask, states = prefill(model, ids, self.mask, new_mask, positions, self.cache, q_chunk, hidden)
        return logits, states

    def feed(self, model, token: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """One decode step: [B] token (live [B] 0/1: finished rows feed a masked pad) → [B,V] logits."""
        assert self.seen is not None and self.mask is not None, "feed after prefill"
        positions = self.seen
        self.seen, self.length = self.seen + live, self.length + 1
        self.mask = torch.cat([self.mask, live[:, None]], dim=1)
        logits = decode_one_token(model, token, self.mask, positions, self.cache)
        self.mask = trim_mask(self.mask, self.cache)
        return logits

    def feed_candidates(self, model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch 1: feed k alternative next tokens [k] at once (the cache repeated k times) → ([k,V] logits,
        [k,1,H] hidden states). `keep_candidate` then keeps one of them."""
        assert self.seen is not None and self.mask is not None, "feed_candidates after prefill"
        k = tokens.shape[0]
        self.cache.batch_repeat_interleave(k)
        mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1).expand(k, -1)  # [k,n+1]
        positions = self.seen[:, None].expand(k, 1)  # [k,1]
        self.candidate_mask = mask[:1]
        logits, hidden = forward(model, tokens[:, None], mask, positions, self.cache, hidden=True)
        assert hidden is not None  # asked for (hidden=True)
        return logits, hidden

    def keep_candidate(self, index: int) -> None:
        """After `feed_candidates`: the cache keeps candidate `index` only, as if it alone had been fed."""
        assert self.seen is not None and self.candidate_mask is not None, "keep_candidate after feed_candidates"
        self.cache.batch_select_indices(torch.tensor([index], device=self.seen.device))
        self.seen, self.length = self.seen + 1, self.length + 1
        self.mask = trim_mask(self.candidate_mask, self.cache)


def eos_ids(model, configured: int | list[int] | None = None) -> set[int]:
    """The ids that end a sequence: `configured` if given, else the model's generation config, else its config."""
    eos = configured
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def pad_id(model, tokenizer, eos: set[int]) -> int:
    """The id a finished row is filled with: the model's pad, the tokenizer's, else the smallest EOS (else 0)."""
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    return int(pad if pad is not None else min(eos, default=0))
