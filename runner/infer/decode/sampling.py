"""Logits → next token: pure functions in the order transformers applies them.

repetition penalty → no-repeat n-gram → temperature → top-k → top-p → min-p → typical → sample (or argmax
when greedy). Each filter
matches the transformers logits processor of the same name (tests compare them on random logits).
Randomness comes only from the `torch.Generator` passed in, never from the global seed.
"""

from __future__ import annotations

import torch

from runner.infer.config.decoding import GenerateConfig
from runner.infer.kernels import native


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


def apply_min_p(logits: torch.Tensor, min_p: float | None) -> torch.Tensor:
    """Drop tokens less likely than min_p × the most likely token's probability (the top token always stays)."""
    if not min_p:
        return logits
    probs = torch.softmax(logits, dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, float("-inf"))


def apply_typical(logits: torch.Tensor, typical_p: float | None) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022): keep the tokens whose surprisal is closest to the entropy,
    in that order, until their mass reaches typical_p (always ≥ 1 token)."""
    if typical_p is None or typical_p >= 1.0:
        return logits
    logprobs = torch.log_softmax(logits, dim=-1)
    entropy = -(logprobs * logprobs.exp()).nansum(-1, keepdim=True)
    distance, order = torch.sort((-logprobs - entropy).abs(), dim=-1)  # most typical first
    cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < typical_p).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    remove_sorted = distance > distance.gather(-1, last)  # ties with the last kept token stay
    remove_sorted[..., :1] = False
    return logits.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), float("-inf"))


def apply_no_repeat_ngram(logits: torch.Tensor, seen_ids: torch.Tensor, size: int) -> torch.Tensor:
    """Ban every token that would complete an n-gram already in the row. [B,V], [B,T] → [B,V]."""
    length = seen_ids.shape[-1]
    if size <= 0 or length < size:
        return logits
    prefix = seen_ids[:, length + 1 - size:]  # [B,n-1]: the n-gram the next token would end
    windows = seen_ids.unfold(1, size, 1)  # [B,W,n] every n-gram so far
    matches = (windows[..., :-1] == prefix[:, None, :]).all(dim=-1)  # [B,W]
    hits = torch.zeros_like(logits).scatter_add_(1, windows[..., -1], matches.to(logits.dtype))  # [B,V] counts
    return logits.masked_fill(hits > 0, float("-inf"))


def apply_penalties(logits: torch.Tensor, seen_ids: torch.Tensor, config: GenerateConfig) -> torch.Tensor:
    """The processors that also apply to deterministic search (greedy, beam, contrastive). [B,V] → [B,V]."""
    logits = apply_repetition_penalty(logits, seen_ids, config.repetition_penalty)
    return apply_no_repeat_ngram(logits, seen_ids, config.no_repeat_ngram_size)


def process_logits(logits: torch.Tensor, seen_ids: torch.Tensor, config: GenerateConfig) -> torch.Tensor:
    """All filters of `config`, in transformers' order. [B,V] → [B,V] float32."""
    logits = apply_penalties(logits.float(), seen_ids, config)
    if config.greedy:
        return logits
    logits = apply_temperature(logits, config.temperature)
    logits = apply_top_p(apply_top_k(logits, config.top_k), config.top_p)
    return apply_typical(apply_min_p(logits, config.min_p), config.typical_p)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[B,V] → [B] the first maximum of each row, exactly logits.argmax(-1): on CPU through runner's kernel when it
    is loaded (aten's CPU argmax is ~7× slower than reading the row: 2 % of a small model's decode step; in bfloat16
    12×, 1.4 ms of a 42 ms 16-row SmolLM2 step), bfloat16 and float16 widened to float32 a row at a time in the
    kernel (exact: same order, same ties)."""
    if (logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and logits.device.type == "cpu" and native.loaded()):
        return torch.ops.runner.argmax_rows(logits)
    return logits.argmax(-1)


def sample(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from softmax(logits). [B,V] → [B]."""
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def next_token(logits: torch.Tensor, seen_ids: torch.Tensor, config: GenerateConfig,
               generator: torch.Generator | None) -> torch.Tensor:
    """[B,V] logits of the last position → [B] token ids."""
    logits = process_logits(logits, seen_ids, config)
    if config.greedy:
        return greedy_tokens(logits)
    return sample(logits, generator)
