"""The pure pieces of a speculative round, shared by the row-by-row and the batched loops (strategies layer).

Owns: the filtered distributions p and q (`filtered_probs`), one pick, prompt-lookup proposals, the two
verification rules (`accept_reject`: min(1, p/q) with the residual draw; `accept_exact`: exact match), the
adaptive-k rule and the fallback rule over a list of (drafted, accepted) rounds, the first EOS of a row and why a
row stops; `SpeculativeStats`, the counts both loops keep, and `RoundRules`, what both loops read besides models and
caches.
Does not know about caches, models, batches or generators: every function takes tensors of one row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runner.infer.config.decoding import GenerateConfig, SpeculativeConfig
from runner.infer.decode.sampling import process_logits

LOOKUP_MAX_NGRAM = 3
FALLBACK_MIN_ROUNDS = 4
FALLBACK_WINDOW = 8


@dataclass
class SpeculativeStats:
    """Counts of the last `.generate()` call, summed over rows."""

    rounds: int = 0  # rounds that drafted ≥ 1 token
    drafted: int = 0
    accepted: int = 0
    accepted_hist: list[int] = field(default_factory=list)  # [n] = rounds that accepted n drafted tokens
    k_history: list[list[int]] = field(default_factory=list)  # per row: tokens drafted in each round (≤ k)
    draft_forwards: int = 0
    target_forwards: int = 0
    target_only_steps: int = 0  # target forwards that verified nothing (fallback, no lookup match, last token)
    fallback_round: list[int | None] = field(default_factory=list)  # per row: round at which it fell back
    new_tokens: list[int] = field(default_factory=list)  # per row, EOS included
    stop_reasons: list[str] = field(default_factory=list)  # per row: eos, max_new_tokens, max_seq_len
    row_drafted: list[int] = field(default_factory=list)  # per row: tokens drafted
    row_accepted: list[int] = field(default_factory=list)  # per row: draft tokens accepted
    batched: bool = False  # rounds ran for the whole batch at once (spec_batch), not row after row
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def row_acceptance(self) -> list[float]:
        """Per row: accepted / drafted (0 for a row that drafted nothing)."""
        return [a / d if d else 0.0 for d, a in zip(self.row_drafted, self.row_accepted)]

    def as_dict(self) -> dict:
        return {"acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
                "accepted_hist": self.accepted_hist, "k_history": self.k_history, "rounds": self.rounds,
                "drafted": self.drafted, "accepted": self.accepted, "draft_forwards": self.draft_forwards,
                "target_forwards": self.target_forwards, "target_only_steps": self.target_only_steps,
                "fallback_round": self.fallback_round, "new_tokens": self.new_tokens,
                "stop_reasons": self.stop_reasons, "row_acceptance": self.row_acceptance,
                "batched": self.batched, "seconds": self.seconds}


@dataclass(frozen=True)
class RoundRules:
    """What a round reads besides the models and caches: the settings, the filters p and q are computed with
    (`sampling`), the target's vocabulary (p and q are over it), its EOS ids, and the one random generator."""

    config: SpeculativeConfig
    sampling: GenerateConfig
    vocab: int
    eos_ids: set[int]
    rng: torch.Generator

    def stop_reason(self, seq: torch.Tensor, prompt_len: int) -> str:
        return stop_reason(seq, prompt_len, self.config, self.eos_ids)


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


def count_round(stats: SpeculativeStats, r: int, drafted: int, accepted: int) -> None:
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


def stop_reason(seq: torch.Tensor, prompt_len: int, cfg: SpeculativeConfig, eos_ids: set[int]) -> str:
    """[L] sequence of a row whose prompt is `prompt_len` tokens → why the row stops now, or "": eos,
    max_new_tokens, max_seq_len."""
    new = seq[prompt_len:]
    if first_eos(new, eos_ids) < min(new.numel(), cfg.max_new_tokens):
        return "eos"
    if new.numel() >= cfg.max_new_tokens:
        return "max_new_tokens"
    return "max_seq_len" if seq.numel() >= cfg.max_seq_len else ""
