"""What the continuous-batching schedulers hold: how they batch (`SchedulerConfig`), each request they hold and its
decode state (`Live`), the seed of its own sampling generator (`request_seed`), and the clock they read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from runner.infer.config.decoding import GenerateConfig
from runner.infer.serve.requests import Request, RequestRecord

Clock = Callable[[], float]


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches. KV budget: `num_blocks`, else `kv_budget_bytes` (→ blocks by the kind's
    estimator), else unbounded."""

    cache_kind: str | None = None  # None: the model's dtype
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None
    kv_budget_bytes: int | None = None
    max_tokens_per_step: int = 256  # decode rows + prefill tokens per step
    max_running: int = 64  # most requests in the running batch (vLLM's max_num_seqs)
    max_queue: int | None = None  # most waiting requests; an arrival beyond it is refused (None: unbounded)
    prefix_caching: bool = False  # reuse prompt blocks of running and finished requests (serve/prefix.py)
    prefix_cache_blocks: int = 512  # most blocks of finished requests' prompts kept for later ones (0: none)
    spec_k: int = 0  # speculation: a greedy decoding row drafts ≤ spec_k tokens (0: none); prompt lookup unless
    # the Scheduler is given a draft model
    sampling: GenerateConfig = field(default_factory=lambda: GenerateConfig(temperature=0.0))  # temperature, top-k/p,
    # penalties, eos_token_id, stop_strings, max_seq_len, seed; max_new_tokens comes from each Request


def request_seed(seed: int | None, request_id: int) -> int:
    """The seed of one request's own torch.Generator: from the run's seed and the request id only."""
    return ((seed or 0) * 1_000_003 + request_id) % 2**63


@dataclass
class Live:
    """A request the scheduler holds (waiting or running) and its decode state."""

    request: Request
    record: RequestRecord
    rng: torch.Generator
    cache: Cache | None = None  # its own cache, while running
    held: int = 0  # tokens in its cache

    @property
    def sequence(self) -> list[int]:
        return [*self.request.prompt_ids, *self.record.output_ids]

    @property
    def target(self) -> int:
        """Tokens to prefill before it decodes: the prompt, or after a preemption prompt + outputs but the last (the
        last output is fed by the next decode step, as in a solo decode)."""
        return len(self.request.prompt_ids) + max(len(self.record.output_ids) - 1, 0)

    @property
    def decoding(self) -> bool:
        return bool(self.record.output_ids) and self.held == self.target
