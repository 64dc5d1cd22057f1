"""The pure pieces of a speculative round, shared by the row-by-row and the batched loops (strategies layer).

Owns: the filtered distributions p and q (`filtered_probs`), one pick, prompt-lookup proposals, the two
verification rules (`accept_reject`: min(1, p/q) with the residual draw; `accept_exact`: exact match), the
adaptive-k rule and the fallback rule over a list of (drafted, accepted) rounds, and the first EOS of a row.
Does not know about caches, models, batches or generators: every function takes tensors of one row.
"""

from __future__ import annotations

import torch

from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.sampling import process_logits

LOOKUP_MAX_NGRAM = 3
FALLBACK_MIN_ROUNDS = 4
FALLBACK_WINDOW = 8


def filtered_probs(logits: torch.Tensor, seq: torch.Tensor, gcfg: GenerateConfig, vocab: int) -> torch.Tensor:
    """[t,V'] logits → [t,vocab] probabilities after temperature/top-k/top-p (vocab aligned to the target's)."""
    if logits.shape[-1] > vocab:
        logits = logits[:, :vocab]
    elif logits.shape[-1] < vocab:
        logits = torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))
    seen = seq[None].expand(logits.shape[0], -1)
    return torch.softmax(process_logits(logits, seen, gcfg), dim=-1)


def pick(probs: torch.Tensor, greedy: bool, rng: torch.Generator) -> int:
    """[V] → one token id: argmax when greedy, else a draw."""
    if greedy:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=rng))


def lookup_proposal(seq: torch.Tensor, k: int) -> torch.Tensor:
    """Prompt lookup: the ≤ k tokens after the latest earlier occurrence of the last n-gram. [L] → [≤k]."""
    tokens = seq.tolist()
    for n in range(min(LOOKUP_MAX_NGRAM, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return seq[start + n:start + n + k]
    return seq[:0]


def accept_reject(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, rng: torch.Generator) -> tuple[int, int]:
    """Rejection sampling. draft [k], q [k,V], p [k+1,V] → (accepted n, token after them or -1 for the bonus)."""
    for i, x in enumerate(draft.tolist()):
        u = float(torch.rand((), generator=rng))
        if u * float(q[i, x]) < float(p[i, x]):
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        residual = residual if float(residual.sum()) > 0 else p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=rng))
    return draft.shape[0], -1


def accept_exact(draft: torch.Tensor, p: torch.Tensor, greedy: bool, rng: torch.Generator) -> tuple[int, int]:
    """Exact match: y_i from p_i; accept while x_i == y_i. draft [k], p [k+1,V] → (n, y_n or -1 for the bonus)."""
    for i, x in enumerate(draft.tolist()):
        y = pick(p[i], greedy, rng)
        if y != x:
            return i, y
    return draft.shape[0], -1


def count_round(stats, r: int, drafted: int, accepted: int) -> None:
    """Add a round of row r that drafted `drafted` tokens and accepted `accepted` to a SpeculativeStats."""
    stats.rounds, stats.drafted, stats.accepted = stats.rounds + 1, stats.drafted + drafted, stats.accepted + accepted
    if accepted >= len(stats.accepted_hist):
        stats.accepted_hist.extend([0] * (accepted + 1 - len(stats.accepted_hist)))
    stats.accepted_hist[accepted] += 1
    stats.k_history[r].append(drafted)
    stats.row_drafted[r] += drafted
    stats.row_accepted[r] += accepted


def adapt_k(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """k + 1 after a fully accepted round, k − 1 after one accepting < half, within [1, k_max]."""
    if accepted == drafted:
        return min(k + 1, k_max)
    return max(k - 1, 1) if accepted < 0.5 * drafted else k


def falls_back(rounds: list[tuple[int, int]], threshold: float) -> bool:
    """(drafted, accepted) per round → whether decoding should go target-only: after ≥ FALLBACK_MIN_ROUNDS
    rounds, the acceptance over the last FALLBACK_WINDOW rounds is below `threshold` (0 = never)."""
    if threshold <= 0 or len(rounds) < FALLBACK_MIN_ROUNDS:
        return False
    recent = rounds[-FALLBACK_WINDOW:]
    return sum(a for _, a in recent) / max(sum(d for d, _ in recent), 1) < threshold


def first_eos(tokens: torch.Tensor, eos_ids: set[int]) -> int:
    """Index of the first EOS in [N] tokens, or N."""
    hits = [i for i, t in enumerate(tokens.tolist()) if t in eos_ids]
    return hits[0] if hits else tokens.numel()
