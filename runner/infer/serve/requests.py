"""What a load is made of and what each request saw: the one interface between the load generator, the
schedulers (continuous and static batching) and the metrics. Torch-free.

Times are seconds from the start of the load (after warm-up), on one monotonic clock. A request's latencies are
measured from its *scheduled* arrival (`arrival_s`), never from when the driver got round to sending it, so time
spent queueing is never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.infer.config.decoding import GenerateConfig


@dataclass(frozen=True)
class Request:
    """One request of a load: its prompt as token ids, when it is due and how many tokens it may produce."""

    id: int
    arrival_s: float  # scheduled arrival (closed-loop loads: set when the previous request of its user finished)
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    min_new_tokens: int = 0  # synthetic loads ask for exact output lengths: EOS is ignored until this many
    group: int | None = None  # shared-prefix group, or conversation, it belongs to
    turn: int = 0  # the turn in a multi-turn conversation
    sampling: GenerateConfig | None = None  # its own sampling (an HTTP request's temperature, top_p, seed, stop);
    # None: the scheduler's. Its max_new_tokens is ignored (the field above counts)


@dataclass
class RequestRecord:
    """What happened to one request. `token_s[i]` is when output token i was produced (token 0: the first token)."""

    id: int
    arrival_s: float
    prompt_tokens: int
    scheduled_s: float | None = None  # first admitted to the running batch
    token_s: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finish: str = ""  # "eos" | "length" | "stop" | "refused" (overload: a bounded queue was full) | "error"
    # | "cancelled" (Scheduler.cancel: its client went away)
    error: str = ""
    preemptions: int = 0  # times its KV blocks were taken back (it was recomputed later)
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def ok(self) -> bool:
        return self.finish in ("eos", "length", "stop")
