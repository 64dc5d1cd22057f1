"""The Generator: the seed API over the forward chain (batches, streaming, stop rules, continuation).

Per call, in order:
    (cache_kind auto: decide_cache_kind, once per batch size) → plan_decode → make the cache of the decided kind
    → DecodeState.prefill → choose (next_token, or the contrastive look-ahead) → DecodeState.feed → ...
    → finished_rows
`Generator` keeps its DecodeState between calls, so a second `.generate()` continues the conversation.
Rows of a left-padded batch are independent: a finished row keeps being fed a masked pad token.
Beam search (beam.py) decides tokens; this loop feeds them and reorders the cache.
`engine: compiled` swaps DecodeState for compiled.state.StaticDecodeState (both are a DecodeStateProtocol): nothing
else here changes.
Does not know about manifests, tracking or printing.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from runner.errors import InferenceError
from runner.infer.cache.window import DecodePlan, make_planned_cache, plan_decode
from runner.infer.compiled.engine import engine_for
from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.beam import BeamSearch
from runner.infer.decode.contrastive import ContrastiveSearch
from runner.infer.decode.forward import DecodeState, DecodeStateProtocol, eos_ids, pad_id
from runner.infer.decode.sampling import next_token
from runner.infer.measure.timing import Stopwatch, on_device
from runner.infer.select.autocache import Selection
from runner.infer.select.decide import decide_cache_kind


@dataclass
class DecodeStats:
    """Timing and stop reasons of the last call; seconds after device sync (CUDA events on CUDA: timing.on_device)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0  # real (unpadded) tokens prefilled, summed over rows
    new_tokens: list[int] = field(default_factory=list)  # per row, EOS included
    stop_reasons: list[str] = field(default_factory=list)  # per row: eos, stop_string, max_new_tokens, max_seq_len
    plan: DecodePlan | None = None  # the decode plan that applied (chunked prefill, sliding window)
    scores: list[float] = field(default_factory=list)  # beam search: length-penalised score per returned sequence

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(self.new_tokens, default=0) - 1  # the first token comes from the prefill
        return steps * len(self.new_tokens) / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0


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
        self.selection: Selection | None = None  # what cache_kind='auto' chose for the last call's batch size
        self._decided: dict[int, tuple[GenerateConfig, Selection | None]] = {}  # batch size → decide_cache_kind's
        self.rng = generator or torch.Generator(self.device).manual_seed(self.config.seed or 0)
        self.eos_ids = eos_ids(model, self.config.eos_token_id)
        self.pad_id = pad_id(model, tokenizer, self.eos_ids)  # what finished rows are filled with
        self.stats = DecodeStats()
        self.plan: DecodePlan | None = None  # the decode plan of the last call
        self.reset()

    def reset(self) -> None:
        """Forget the conversation: the next call starts from an empty cache."""
        self.state: DecodeStateProtocol | None = None  # the cache and what was fed into it; None until the first call
        self.sequence: torch.Tensor | None = None  # [B,P+1] every token so far (penalties)
        self.pending: torch.Tensor | None = None  # [B] last sampled token, not yet in the cache
        self.search: ContrastiveSearch | None = None  # hidden states of the context when penalty_alpha is set

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B,T] prompt (left-padded) → [B,T+N]: the prompt then this turn's tokens (pad after a row stops).
        Beam search: [B·R,T+N], the R = num_return_sequences best per prompt, best first."""
        if self.config.num_beams > 1:
            return self._beam_search(input_ids, attention_mask)
        new = torch.stack(list(self.steps(input_ids, attention_mask)), dim=1)  # max_new_tokens ≥ 1
        return torch.cat([input_ids.to(self.device), new], dim=1)

    def generate_iter(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Iterator[int]:
        """Yield token ids one at a time as they are decided (batch of one)."""
        if input_ids.shape[0] != 1:
            raise ValueError("generate_iter streams one sequence; use generate() or steps() for a batch")
        for token in self.steps(input_ids, attention_mask):
            yield int(token[0])

    def _decide(self, batch: int) -> str | None:
        """The cache kind a first call of `batch` rows decodes with, decided before it decodes: the config's, or
        for cache_kind 'auto' what decide_cache_kind chose for that batch size (the budget depends on the batch)."""
        if batch not in self._decided:
            self._decided[batch] = decide_cache_kind(self.model, self.tokenizer, self.config, batch_size=batch)
        config, selection = self._decided[batch]
        if selection is not None:
            self.selection = selection
        return config.cache_kind

    def _start(self, ids: torch.Tensor) -> tuple[DecodeStateProtocol, DecodePlan]:
        """Decide the cache kind (a first call), plan this call and make the cache if there is none yet → the
        state and the plan of this call (also `self.state`, `self.plan`)."""
        if self.length + ids.shape[1] >= self.config.max_seq_len:
            raise InferenceError(f"prompt of {self.length + ids.shape[1]} tokens does not fit "
                            f"max_seq_len={self.config.max_seq_len}")
        kind = self._decide(ids.shape[0]) if self.state is None else None  # before anything is decoded
        plan = plan_decode(self.config, self.length + ids.shape[1])
        if self.state is not None:  # a continued conversation keeps the cache (and window) of its first call
            layers = self.state.cache.layers
            window = getattr(layers[0], "window", None) if layers else None
            plan = dataclasses.replace(plan, local_window=window)
        self.plan = plan
        if plan.local_window:
            warnings.warn(plan.describe(), stacklevel=3)
        if self.state is None and self.config.engine == "compiled":
            needed = ids.shape[1] + (self.config.max_new_tokens if self.config.num_beams == 1 else
                                     self.config.max_new_tokens + 1)
            prefill = ids.shape[1] if self.config.prefill == "compiled" else 0
            self.state = engine_for(self.model).state(kind, ids.shape[0], needed, self.config.max_seq_len,
                                                      prefill=prefill)
        elif self.state is None:
            self.state = DecodeState(make_planned_cache(kind, self.model, plan))
        return self.state, plan

    @property
    def length(self) -> int:
        """Columns (tokens and pads) fed into the cache so far."""
        return self.state.length if self.state is not None else 0

    @property
    def cache(self):
        return self.state.cache if self.state is not None else None

    @torch.inference_mode()
    def steps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """Yield [B] tokens per step; finished rows yield the pad id. Fills `self.stats`."""
        cfg = self.config
        if cfg.num_beams > 1:
            raise ValueError("beam search decides its tokens only at the end: use generate(), not streaming")
        ids = input_ids.to(self.device)
        new_mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).to(self.device)
        if cfg.contrastive and ids.shape[0] != 1:
            raise ValueError("contrastive search (penalty_alpha) decodes one sequence at a time: batch of 1")
        if self.pending is not None:  # continue: the last token of the previous turn enters the cache first
            ids = torch.cat([self.pending[:, None], ids], dim=1)
            new_mask = torch.cat([torch.ones_like(self.pending[:, None]), new_mask], dim=1)
        state, plan = self._start(ids)
        batch = ids.shape[0]
        self.stats = DecodeStats(prompt_tokens=int(new_mask.sum()), new_tokens=[0] * batch,
                                 stop_reasons=[""] * batch, plan=plan)

        watch = Stopwatch(**on_device(self.device))
        logits, states = state.prefill(self.model, ids, new_mask, plan.q_chunk, hidden=cfg.contrastive)
        search = None
        if cfg.contrastive:
            assert states is not None  # asked for (hidden=True)
            search = self.search = self.search or ContrastiveSearch(cfg)
            search.add_context(states)
        self.sequence = ids if self.sequence is None else torch.cat([self.sequence, ids], dim=1)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        pad = torch.full((batch,), self.pad_id, dtype=torch.long, device=self.device)
        for step in range(cfg.max_new_tokens):
            if search is not None:  # contrastive: the look-ahead feeds the chosen token: the cache already holds it
                assert isinstance(state, DecodeState)  # the compiled engine's state refuses hidden states (prefill)
                token, logits = search.choose(self.model, state, self.sequence, logits)
            else:
                token = torch.where(done, pad, next_token(logits, self.sequence, cfg, self.rng))
            if step == 0:
                self.stats.prefill_s = watch.lap()
            self.sequence = torch.cat([self.sequence, token[:, None]], dim=1)
            self.pending = None if cfg.contrastive else token
            newly_done = self._finished_rows(token, done, step)
            done = done | newly_done
            yield token
            if bool(done.all()):
                break
            if not cfg.contrastive:
                logits = state.feed(self.model, token, (~done).long())
        self.stats.decode_s = watch.lap()

    @torch.inference_mode()
    def _beam_search(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        if self.pending is not None or self.state is not None:
            raise ValueError("beam search starts from an empty cache: call reset() before it")
        ids = input_ids.to(self.device).repeat_interleave(cfg.num_beams, dim=0)  # [B·K,T]: every beam, as transformers
        new_mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).to(self.device)
        new_mask = new_mask.repeat_interleave(cfg.num_beams, dim=0)
        state, plan = self._start(ids)
        max_len = min(ids.shape[1] + cfg.max_new_tokens, cfg.max_seq_len)
        search = BeamSearch(input_ids.to(self.device), cfg, self.eos_ids, self.pad_id, max_len)
        self.stats = DecodeStats(prompt_tokens=int(new_mask.sum()) // cfg.num_beams, plan=plan)
        watch = Stopwatch(**on_device(self.device))
        logits, _ = state.prefill(self.model, ids, new_mask, plan.q_chunk)
        self.stats.prefill_s = watch.lap()
        while True:
            parents, go_on = search.step(logits)
            # transformers annotates beam_idx as the legacy torch.LongTensor class; parents is a long tensor
            state.cache.reorder_cache(parents)  # type: ignore[arg-type]
            if not go_on:
                break
            logits = state.feed(self.model, search.next_tokens(), torch.ones_like(parents))
        self.stats.decode_s = watch.lap()
        result = search.result()
        self.stats.new_tokens, self.stats.scores = result.new_tokens, result.scores.tolist()
        self.stats.stop_reasons = [self._beam_stop_reason(seq, n, ids.shape[1], max_len)
                                   for seq, n in zip(result.sequences, result.new_tokens)]
        self.reset()  # the beams' cache cannot continue one conversation
        return result.sequences

    def _beam_stop_reason(self, sequence: torch.Tensor, new_tokens: int, prompt_len: int, max_len: int) -> str:
        if int(sequence[prompt_len + new_tokens - 1]) in self.eos_ids:
            return "eos"
        return "max_new_tokens" if max_len == prompt_len + self.config.max_new_tokens else "max_seq_len"

    def _finished_rows(self, token: torch.Tensor, done: torch.Tensor, step: int) -> torch.Tensor:
        """[B] bool: rows that stop after this token; records how many tokens each row made and why."""
        finished = torch.zeros_like(done)
        full = self.length + (self.pending is not None) >= self.config.max_seq_len  # tokens so far
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
        assert self.sequence is not None  # steps() set it before asking
        text = self.tokenizer.decode(self.sequence[row, -min(n_new, tail):], skip_special_tokens=False)
        return any(s in text for s in stops)


def generate(model, input_ids: torch.Tensor, config: GenerateConfig | None = None,
             attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
             tokenizer=None, **settings) -> torch.Tensor:
    """Stateless: `generate(model, ids, max_new_tokens=64, temperature=0.8)` → [B,T+N] token ids."""
    base = config.model_dump(exclude_unset=True) if config is not None else {}
    config = GenerateConfig.model_validate({**base, **settings})
    return Generator(model, config=config, tokenizer=tokenizer, generator=generator).generate(input_ids, attention_mask)
