"""Logits → next token: pure functions in the order transformers applies them.

repetition penalty → temperature → top-k → top-p → sample (or argmax when greedy). Each filter
matches the transformers logits processor of the same name (tests compare them on random logits).
Randomness comes only from the `torch.Generator` passed in, never from the global seed.
"""

from __future__ import annotations

import torch

from runner.infer.config import GenerateConfig


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL penalty: divide positive, multiply negative logits of tokens already seen. [B,V], [B,T] → [B,V]."""
    if penalty == 1.0:
        return logits
    score = torch.gather(logits, 1, seen_ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(1, seen_ids, score)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature in (0.0, 1.0) else logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept, as transformers does)."""
    if not top_k or top_k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float | None) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (always ≥ 1 token)."""
    if top_p is None or top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def process_logits(logits: torch.Tensor, seen_ids: torch.Tensor, config: GenerateConfig) -> torch.Tensor:
    """All filters of `config`, in transformers' order. [B,V] → [B,V] float32."""
    logits = apply_repetition_penalty(logits.float(), seen_ids, config.repetition_penalty)
    if config.greedy:
        return logits
    logits = apply_temperature(logits, config.temperature)
    return apply_top_p(apply_top_k(logits, config.top_k), config.top_p)


def sample(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from softmax(logits). [B,V] → [B]."""
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def next_token(logits: torch.Tensor, seen_ids: torch.Tensor, config: GenerateConfig,
               generator: torch.Generator | None) -> torch.Tensor:
    """[B,V] logits of the last position → [B] token ids."""
    logits = process_logits(logits, seen_ids, config)
    if config.greedy:
        return logits.argmax(dim=-1)
    return sample(logits, generator)
