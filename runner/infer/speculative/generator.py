"""Speculative decoding (Leviathan et al. 2023, Chen et al. 2023): a draft proposes, the target verifies.

Owns: draft → verify → accept → roll back, per round, for a draft model or prompt lookup; the adaptive draft
length, the fallback to target-only decoding, and the counts in `SpeculativeStats`. A draft with another tokenizer
(`draft_tokenizer=`, `tokenizer=` the target's) proposes through text (`text.TextDraft`), verified as prompt
lookup is. The draft side, whichever it is, is one `draft.Draft`; what a round reads besides models and caches is one
`rounds.RoundRules`: the batched loop (`batch.py`) is handed both. Does not know about manifests, tracking or timing
beyond wall-clock.

One round of one row (shapes in comments), with the invariant "each cache holds the sequence minus its last
token, `pending`":
    propose (draft: k forwards, sampling x_i ~ q_i from the draft's filtered distribution; prompt lookup: the
    tokens that followed the last earlier n-gram, n = 3, 2, 1, q one-hot) → verify (one target forward over
    [pending, x_1..x_k]: p_1..p_{k+1}) → accept (reject_sampling: x_i with probability min(1, p_i/q_i), the first
    rejection resamples from norm(max(p_i − q_i, 0)); greedy: exact match, y_i ~ p_i (argmax at temperature 0)
    and x_i is accepted while x_i == y_i, the first mismatch emits y_i) → bonus token from p_{k+1} after a fully
    accepted round when spec_extra_token → crop both caches back to the kept sequence (every cache kind; for KIVI
the chunk stops before the token that quantizes the residual, see `tokens_before_flush`).
Either way the emitted tokens are distributed as the target's own (filtered) samples; at temperature 0 they are
the target's greedy tokens. Every random draw uses the one explicit `torch.Generator`.

Adaptive k (spec_k_adaptive): after a round that drafted k_r tokens and accepted n: k += 1 if n == k_r,
k −= 1 if n < 0.5·k_r, clamped to [1, 2·spec_k]. Fallback: once a row has done ≥ FALLBACK_MIN_ROUNDS rounds,
if the acceptance rate over its last FALLBACK_WINDOW rounds is below spec_disable_below_accept, the row decodes
target-only from then on (recorded in `stats.fallback_round`).

engine: compiled gives each row static states (compiled.state.StaticDecodeState): verification of spec_k + 1 tokens and
single-token steps run compiled, other chunk lengths the same static forward eagerly; rolling back is moving the
write position (`crop`).

Batches: a batch of more than one row runs its rounds together (`batch.py`: one draft forward per draft
token and one target forward per round for all live rows, ragged acceptance kept as masked holes in the caches,
adaptive k and the fallback per batch). Cache kinds that cannot hold holes (KIVI, sliding windows: see
`ragged.py`), the compiled engine and `batched=False` process rows one after another, each with its own batch-1
caches (its left padding stripped); forward counts are then summed over rows.
"""

from __future__ import annotations

import logging

import torch

from runner.errors import InferenceError
from runner.infer.cache.registry import make_cache
from runner.infer.compiled.engine import engine_for
from runner.infer.compiled.state import StaticDecodeState
from runner.infer.config.decoding import GenerateConfig, SpeculativeConfig
from runner.infer.decode.forward import eos_ids, pad_id
from runner.infer.measure.timing import on_device, time_once
from runner.infer.speculative.batch import batched_reason, generate_batched
from runner.infer.speculative.draft import PROMPT_LOOKUP, Draft
from runner.infer.speculative.rounds import (  # noqa: F401
    FALLBACK_MIN_ROUNDS,
    FALLBACK_WINDOW,
    LOOKUP_MAX_NGRAM,
    RoundRules,
    SpeculativeStats,
    accept_exact,
    accept_reject,
    adapt_k,
    count_round,
    falls_back,
    filtered_probs,
    first_eos,
    lookup_proposal,
    pick,
    stop_reason,
)
from runner.infer.speculative.text import TextDraft, same_tokenizer

log = logging.getLogger(__name__)


class _Row:
    """One sequence and its caches: `seq` [L] every token so far; each cache holds seq[:-1] (or less, draft)."""

    def __init__(self, seq: torch.Tensor, target_cache, draft_cache):
        self.seq, self.target_cache, self.draft_cache = seq, target_cache, draft_cache
        self.rounds: list[tuple[int, int]] = []  # (drafted, accepted)


def cached_len(cache) -> int:
    return cache.get_seq_length() if cache is not None else 0


def feed(model, cache, tokens: torch.Tensor, keep: int = 1) -> torch.Tensor:
    """Append [t] tokens of a batch-1 row to `cache`; logits at the last `keep` of them. [t] → [keep,V] float32.
    A static state of the compiled engine feeds itself (its own mask and columns)."""
    if isinstance(cache, StaticDecodeState):
        return cache.feed_row(model, tokens, keep)
    past = cached_len(cache)
    positions = torch.arange(past, past + tokens.shape[0], device=tokens.device)[None]
    mask = torch.ones(1, past + tokens.shape[0], dtype=torch.long, device=tokens.device)
    out = model(input_ids=tokens[None], attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=keep)
    return out.logits[0].float()


def tokens_before_flush(cache, cached: int) -> int:
    """Most draft tokens a verify chunk may hold so that no token in it completes a KIVI residual.

    A KIVI layer quantizes its residual when it fills (cache index i ≥ s with (i + 1 − s) % residual_len == 0, s its
    sinks). Fed one by one, that index is quantized by its own forward; fed inside a chunk, earlier chunk tokens
    would see it (and its group) quantized, and a crop across it would leave dequantized values behind: the greedy
    output would depend on the chunking. So a chunk [pending, x_1..x_k] (indices cached..cached+k) stops before the
    index that flushes first in any layer, and that index enters alone as the pending token of a target-only step.
    Other kinds: no limit.
    """
    to_flush = [_to_flush(layer, cached) for layer in getattr(cache, "layers", [])
                if getattr(layer, "residual_len", 0)]
    return max(min(to_flush) - 1, 0) if to_flush else 1 << 30


def _to_flush(layer, cached: int) -> int:
    """n such that index cached + n is the next to complete the KIVI `layer`'s residual (none among its sinks)."""
    period, sinks = layer.residual_len, getattr(layer, "sinks", 0)
    first = max(cached, sinks)  # the first index that can enter the residual
    return first - cached + period - 1 - (first - sinks) % period


def crop_to(cache, length: int) -> None:
    """Roll `cache` back to its first `length` tokens (crop takes a negative count)."""
    extra = cached_len(cache) - length
    if extra > 0:
        cache.crop(-extra)


class SpeculativeGenerator:
    """`SpeculativeGenerator(target_model=..., draft_model=... | "prompt-lookup", config=...)`, `.generate(ids)`."""

    def __init__(self, target_model, draft_model, config: SpeculativeConfig | None = None, tokenizer=None,
                 generator: torch.Generator | None = None, batched: bool = True, draft_tokenizer=None):
        self.config = config or SpeculativeConfig()
        self.batched = batched  # a batch of > 1 rows runs its rounds together (spec_batch); False: row after row
        self.device = next(target_model.parameters()).device
        self.target = target_model.eval()
        lookup = isinstance(draft_model, str)
        if lookup and draft_model != PROMPT_LOOKUP:
            raise ValueError(f"draft_model must be a model or {PROMPT_LOOKUP!r} (got {draft_model!r})")
        model = None if lookup else draft_model.to(self.device).eval()
        self.tokenizer = tokenizer
        if model is not None and draft_tokenizer is not None and not same_tokenizer(tokenizer, draft_tokenizer):
            # a draft with another tokenizer proposes through text (text.TextDraft), row by row
            self.draft = Draft(text=TextDraft(model, draft_tokenizer, tokenizer, self.config.cache_kind))
        else:
            self.draft = Draft(model)
        self.rng = generator or torch.Generator(self.device).manual_seed(self.config.seed or 0)
        cfg = self.config
        self.sampling = GenerateConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        self.vocab = target_model.get_output_embeddings().weight.shape[0]
        self.eos_ids = eos_ids(target_model)
        self.stats = SpeculativeStats()

    @property
    def acceptance_rate(self) -> float:
        return self.stats.acceptance_rate

    @property
    def text_draft(self) -> TextDraft | None:
        """The draft with another tokenizer, when the draft is one."""
        return self.draft.text

    def rules(self) -> RoundRules:
        """What this generator's rounds read besides models and caches (its settings as they stand now)."""
        return RoundRules(self.config, self.sampling, self.vocab, self.eos_ids, self.rng)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B,T] prompt (left-padded) → [B,T+N]: the prompt then the new tokens (pad after a row stops)."""
        ids = input_ids.to(self.device)
        mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).to(self.device)
        batch, k_max = ids.shape[0], 2 * self.config.spec_k if self.config.spec_k_adaptive else self.config.spec_k
        self.stats = SpeculativeStats(accepted_hist=[0] * (k_max + 1), k_history=[[] for _ in range(batch)],
                               fallback_round=[None] * batch, new_tokens=[0] * batch, stop_reasons=[""] * batch,
                               row_drafted=[0] * batch, row_accepted=[0] * batch)
        for r, real in enumerate(mask.sum(-1).tolist()):  # before any compiling
            if real == 0:
                raise InferenceError(f"row {r} of the batch has no prompt tokens")
            if real >= self.config.max_seq_len:
                raise InferenceError(f"prompt of {real} tokens does not fit max_seq_len={self.config.max_seq_len}")
        rows: list[torch.Tensor] = []  # [N_r] new tokens of each row
        self.draft.reset()
        self.stats.batched = (batch > 1 and self.batched and self.config.engine != "compiled"
                              and not self._row_by_row_reason())

        def decode_rows() -> None:
            if self.stats.batched:
                rows.extend(generate_batched(self.target, self.draft, self.rules(), self.stats, ids, mask))
            else:
                rows.extend(self._generate_row(r, ids[r][mask[r].bool()]) for r in range(batch))

        if self.config.engine == "compiled":  # compile every shape the rows will use now, not inside the timing
            for r in range(batch):
                self._cache(self.target, ids[r][mask[r].bool()], verify=True)
                if self.draft.model is not None:
                    self._cache(self.draft.model, ids[r][mask[r].bool()], verify=False)

        self.stats.seconds = time_once(decode_rows, **on_device(self.device))
        self.stats.draft_forwards += self.draft.text_forwards
        new = torch.full((batch, max(len(r) for r in rows)), pad_id(self.target, self.tokenizer, self.eos_ids),
                         dtype=torch.long, device=self.device)
        for r, tokens in enumerate(rows):
            new[r, :len(tokens)] = tokens
        return torch.cat([ids, new], dim=1)

    def _row_by_row_reason(self) -> str:
        """Why this generator's caches cannot hold a ragged batch (then rows go one after another), or ""."""
        reason = batched_reason(self.target, self.draft, self.config.cache_kind)
        if reason:
            log.info("speculative decoding goes row by row with cache kind %s: %s", self.config.cache_kind, reason)
        return reason

    def _generate_row(self, r: int, prompt: torch.Tensor) -> torch.Tensor:
        """[T] real prompt tokens → [N] new tokens of row r, stop rules applied."""
        cfg = self.config
        row = _Row(prompt, self._cache(self.target, prompt, verify=True),
                   None if self.draft.model is None else self._cache(self.draft.model, prompt, verify=False))
        self._prefill(row)
        k, target_only = cfg.spec_k, False
        while True:
            produced = row.seq.numel() - prompt.numel()
            room = min(cfg.max_new_tokens - produced, cfg.max_seq_len - row.seq.numel())
            k_round = 0 if target_only else min(k, room - 1 if cfg.spec_extra_token else room)
            k_round = min(k_round, tokens_before_flush(row.target_cache, row.seq.numel() - 1))
            rounds_before = len(row.rounds)
            new = self._round(r, row, k_round)  # [1..k_round+1] tokens
            row.seq = torch.cat([row.seq, new])
            reason = stop_reason(row.seq, prompt.numel(), cfg, self.eos_ids)
            if reason:
                out = row.seq[prompt.numel():]
                out = out[:first_eos(out, self.eos_ids) + 1] if reason == "eos" else out[:cfg.max_new_tokens]
                self.stats.new_tokens[r], self.stats.stop_reasons[r] = out.numel(), reason
                return out
            if len(row.rounds) > rounds_before:  # this round verified draft tokens
                k = self._adapt_k(k, *row.rounds[-1])
                if not target_only and self._should_fall_back(row):
                    target_only, self.stats.fallback_round[r] = True, len(row.rounds)

    def _cache(self, model, prompt: torch.Tensor, verify: bool):
        """An empty cache for one row: the eager engine's growing cache, or a static state of the compiled engine
        whose compiled steps take 1 token (and, verifying, spec_k + 1)."""
        cfg = self.config
        if cfg.engine == "eager":
            return make_cache(cfg.cache_kind, model)
        columns = prompt.numel() + cfg.max_new_tokens + 2 * cfg.spec_k + 2
        lengths = (1, cfg.spec_k + 1) if verify else (1,)
        return engine_for(model).state(cfg.cache_kind, 1, columns, max(cfg.max_seq_len, columns), lengths,
                                       slot="target" if verify else "draft")

    def _prefill(self, row: _Row) -> None:
        """Both caches take the prompt minus its last token (that one enters with the first round)."""
        if row.seq.numel() > 1:
            feed(self.target, row.target_cache, row.seq[:-1])
            self.stats.target_forwards += 1
            if self.draft.model is not None:
                feed(self.draft.model, row.draft_cache, self.draft.tokens(row.seq[:-1]))
                self.stats.draft_forwards += 1

    def _round(self, r: int, row: _Row, k: int) -> torch.Tensor:
        """Propose ≤ k, verify in one target forward, accept, roll back. → [n+1] new tokens ([n] without bonus)."""
        draft, q = self._propose(r, row, k)  # [k'], [k',V] or None
        base = row.seq.numel()
        chunk = torch.cat([row.seq[-1:], draft])  # [k'+1]: pending, then the draft
        p = filtered_probs(feed(self.target, row.target_cache, chunk, keep=chunk.numel()),
                           row.seq, self.sampling, self.vocab)  # [k'+1,V]
        self.stats.target_forwards += 1
        if draft.numel() == 0:
            self.stats.target_only_steps += 1
            return torch.tensor([pick(p[0], self.config.greedy, self.rng)], device=self.device)
        if self.config.greedy or self.config.spec_method == "greedy":
            n, token = accept_exact(draft, p, self.config.greedy, self.rng)
        else:
            assert q is not None  # a non-empty draft comes with its q (_propose)
            n, token = accept_reject(draft, q, p, self.rng)
        if token < 0 and self.config.spec_extra_token:
            token = pick(p[n], self.config.greedy, self.rng)
        new = torch.cat([draft[:n], torch.tensor([token] if token >= 0 else [], dtype=torch.long,
                                                 device=self.device)])
        crop_to(row.target_cache, base + new.numel() - 1)
        if row.draft_cache is not None:
            crop_to(row.draft_cache, base + new.numel() - 1)
        self._count(r, row, draft.numel(), n)
        return new

    def _propose(self, r: int, row: _Row, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens [k] and their proposal distributions q [k,V] (None when greedy or prompt lookup)."""
        if k <= 0:
            return row.seq[:0], None
        if self.draft.model is None:
            draft = self.draft.propose(r, row.seq, k)
            q = torch.zeros(draft.numel(), self.vocab, device=self.device)
            return draft, q.scatter_(1, draft[:, None], 1.0)
        tokens, probs = [], []
        model = self.draft.model
        logits = feed(model, row.draft_cache, self.draft.tokens(row.seq[cached_len(row.draft_cache):]))  # [1,V']
        for i in range(k):
            self.stats.draft_forwards += 1
            q = filtered_probs(logits, row.seq, self.sampling, self.vocab)[0]  # [V]
            tokens.append(pick(q, self.config.greedy, self.rng))
            probs.append(q)
            if i + 1 < k:
                last = torch.tensor(tokens[-1:], device=self.device)  # [1]
                logits = feed(model, row.draft_cache, self.draft.tokens(last))
        return torch.tensor(tokens, device=self.device), torch.stack(probs)

    def _count(self, r: int, row: _Row, drafted: int, accepted: int) -> None:
        row.rounds.append((drafted, accepted))
        count_round(self.stats, r, drafted, accepted)

    def _adapt_k(self, k: int, drafted: int, accepted: int) -> int:
        return adapt_k(k, drafted, accepted, 2 * self.config.spec_k) if self.config.spec_k_adaptive else k

    def _should_fall_back(self, row: _Row) -> bool:
        return falls_back(row.rounds, self.config.spec_disable_below_accept)
