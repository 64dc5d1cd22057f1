"""The load generator: when requests arrive and what they hold, the same byte for byte from the same seeds. Torch-free.

Arrivals (`arrival_seed`): `poisson` (exponential gaps of mean 1/rate), `gamma` (gaps of shape `burstiness`, scale
1/(rate × burstiness): mean 1/rate, coefficient of variation 1/sqrt(burstiness); 1 is Poisson, below 1 burstier, as
vLLM's `vllm bench serve --burstiness`), `constant` (i / rate), all with the first request at 0 s; or the closed loop
`concurrency` (N users, each sending its next request when its previous one finished). Data (`data_seed`): each
conversation draws its lengths and text offsets from its own stream, so a load of 200 requests begins with the load of
100, and the arrival process never changes the data.

How a driver (a scheduler's step) serves a Load: submit `load.requests` at their `arrival_s` (a closed loop's are the
first request of each user, all at 0); each time a request finishes, call `load.follow_up(record, now_s)` and submit
what it returns (a conversation's next turn, a closed-loop user's next request) with `arrival_s = now_s`; None: nothing
follows. Warm-up is a load of its own (`build_load(..., warmup=True)`), served before the clock of the measured one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from runner.errors import DataError
from runner.infer.serve.prompts import PromptFile, Tokenizer, TokenPool
from runner.infer.serve.requests import Request, RequestRecord

ARRIVALS = ("poisson", "gamma", "constant", "concurrency")
DISTS = ("fixed", "uniform", "normal")
NORMAL_TAIL_STD = 4  # a normal length without `max` is clipped at mean + 4 std


@dataclass(frozen=True)
class Lengths:
    """A token count per request: `fixed` (value), `uniform` over [min, max] inclusive, or `normal` (mean, std)
    rounded to the nearest integer and clipped to [min, max] (min 1 and max mean + 4 std unless given)."""

    dist: str = "fixed"
    value: int | None = None
    min: int | None = None
    max: int | None = None
    mean: float | None = None
    std: float | None = None

    def problem(self) -> str | None:
        """Why these lengths cannot be drawn (keys missing or out of place, min above max), or None."""
        needs = {"fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std")}.get(self.dist)
        if needs is None:
            return f"unknown distribution {self.dist!r}: one of {', '.join(DISTS)}"
        allowed = needs + (("min", "max") if self.dist == "normal" else ())
        missing = [k for k in needs if getattr(self, k) is None]
        extra = [k for k in ("value", "min", "max", "mean", "std") if k not in allowed and getattr(self, k) is not None]
        if missing:
            return f"dist {self.dist} needs {' and '.join(needs)}: {missing[0]} is missing"
        if extra:
            return f"dist {self.dist} takes {', '.join(allowed)}, not {extra[0]}"
        if self.low > self.high:
            return f"min {self.low} is above max {self.high}"
        return None

    @property
    def low(self) -> int:
        return self.value if self.dist == "fixed" and self.value is not None else self.min or 1

    @property
    def high(self) -> int:
        if self.dist == "fixed" and self.value is not None:
            return self.value
        if self.max is not None:
            return self.max
        return max(1, math.ceil((self.mean or 0) + NORMAL_TAIL_STD * (self.std or 0)))

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            return self.low
        if self.dist == "uniform":
            return rng.randint(self.low, self.high)
        drawn = round(rng.gauss(self.mean or 0.0, self.std or 0.0))
        return min(max(drawn, self.low), self.high)


def gaps_s(arrival: str, rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Inter-arrival gaps in seconds of an open-loop arrival process, endless."""
    if arrival == "poisson":
        while True:
            yield rng.expovariate(rate)
    if arrival == "gamma":
        while True:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    raise ValueError(f"arrival {arrival!r} has no random gaps (poisson, gamma)")


def arrival_times_s(arrival: str, rate: float, *, count: int | None = None, duration_s: float | None = None,
                    burstiness: float = 1.0, seed: int | str = 0) -> list[float]:
    """Scheduled arrivals of an open-loop load: the first at 0, then `count` in all, or all before `duration_s`."""
    if (count is None) == (duration_s is None):
        raise ValueError("give count or duration_s, not both")
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0 (got {rate}, {burstiness})")
    limit = count if count is not None else math.inf
    if arrival == "constant":
        times, i = [], 0
        while i < limit and (duration_s is None or i / rate < duration_s or i == 0):
            times.append(i / rate)
            i += 1
        return times
    times, now, gaps = [], 0.0, gaps_s(arrival, rate, burstiness, random.Random(seed))
    while len(times) < limit and (duration_s is None or now < duration_s or not times):
        times.append(now)
        now += next(gaps)
    return times


@dataclass(frozen=True)
class LoadSpec:
    """A load as the manifest's `serve:` block gives it, for one rate (each rate of a sweep is its own LoadSpec)."""

    arrival: str = "poisson"
    rate: float | None = None  # requests (conversations) per second; open loop
    burstiness: float = 1.0
    concurrency: int | None = None  # users; closed loop
    num_requests: int | None = 100  # conversations when turns > 1
    duration_s: float | None = None
    warmup_requests: int = 0
    prompt_tokens: Lengths | None = None  # None: 128 from the text, or a prompts file's prompts whole
    output_tokens: Lengths = field(default_factory=lambda: Lengths("fixed", 128))
    prefix_groups: int = 0
    prefix_tokens: int = 0
    turns: int = 1
    arrival_seed: int = 0
    data_seed: int = 0


DEFAULT_PROMPT = Lengths("fixed", 128)


@dataclass(frozen=True)
class Turn:
    user_ids: tuple[int, ...]  # turn 0: the whole prompt (shared prefix first); later turns: the new user tokens
    max_new_tokens: int


class Load:
    """The requests of one load and what follows each when it finishes (see the module's docstring)."""

    def __init__(self, spec: LoadSpec, pool: TokenPool | None, prompts: PromptFile | None, tag: str = ""):
        self.spec, self.pool, self.prompts, self.tag = spec, pool, prompts, tag
        self.closed_loop = spec.arrival == "concurrency"
        self._issued: dict[int, Request] = {}  # requests whose conversation may go on, by id
        self._prefixes: dict[int, tuple[int, ...]] = {}
        self.requests = self._first_requests()

    def follow_up(self, record: RequestRecord, now_s: float) -> Request | None:
        """The request that follows `record`'s when it finished at `now_s`: the next turn of its conversation (when
        it finished ok), else a closed-loop user's next conversation while the load lasts; None when none does."""
        spec, previous = self.spec, self._issued.pop(record.id, None)
        if previous is None:
            return None
        conversation, turn = divmod(record.id, spec.turns)
        if record.ok and turn + 1 < spec.turns:
            nxt = self._conversation(conversation)[turn + 1]
            prompt = previous.prompt_ids + tuple(record.output_ids) + nxt.user_ids
            return self._issue(replace(previous, id=record.id + 1, arrival_s=now_s, prompt_ids=prompt,
                                       max_new_tokens=nxt.max_new_tokens, min_new_tokens=nxt.max_new_tokens,
                                       turn=turn + 1))
        if not self.closed_loop:
            return None
        following = conversation + (spec.concurrency or 1)  # users take conversations round robin
        within = following < spec.num_requests if spec.num_requests is not None else now_s < (spec.duration_s or 0)
        return self._first_turn(following, now_s) if within else None

    def _first_requests(self) -> list[Request]:
        spec = self.spec
        if self.closed_loop:
            users = spec.concurrency or 1
            count = users if spec.num_requests is None else min(users, spec.num_requests)
            return [self._first_turn(c, 0.0) for c in range(count)]
        assert spec.rate is not None, "an open-loop load needs a rate"
        times = arrival_times_s(spec.arrival, spec.rate, count=spec.num_requests, duration_s=spec.duration_s,
                                burstiness=spec.burstiness, seed=f"{spec.arrival_seed}{self.tag}")
        return [self._first_turn(c, t) for c, t in enumerate(times)]

    def _first_turn(self, conversation: int, arrival_s: float) -> Request:
        spec, first = self.spec, self._conversation(conversation)[0]
        group = conversation % spec.prefix_groups if spec.prefix_groups else (conversation if spec.turns > 1
                                                                                else None)
        return self._issue(Request(id=conversation * spec.turns, arrival_s=arrival_s, prompt_ids=first.user_ids,
                                   max_new_tokens=first.max_new_tokens, min_new_tokens=first.max_new_tokens,
                                   group=group))

    def _issue(self, request: Request) -> Request:
        if self.closed_loop or request.turn + 1 < self.spec.turns:
            self._issued[request.id] = request
        return request

    def _conversation(self, conversation: int) -> list[Turn]:
        """Every turn's new tokens and output length, drawn from the conversation's own stream."""
        spec = self.spec
        rng = random.Random(f"{spec.data_seed}{self.tag}:conversation:{conversation}")
        lengths = spec.prompt_tokens or (None if self.prompts is not None else DEFAULT_PROMPT)
        turns = []
        for t in range(spec.turns):
            prompt_n = lengths.sample(rng) if lengths is not None else None
            output_n = spec.output_tokens.sample(rng)
            prefix = self._prefix(conversation % spec.prefix_groups) if spec.prefix_groups and t == 0 else ()
            own_n = None if prompt_n is None else prompt_n - len(prefix)
            if own_n is not None and own_n < 1:
                raise DataError(f"prefix_tokens {len(prefix)} leaves no tokens of a {prompt_n}-token prompt")
            own = (self.prompts.take(conversation * spec.turns + t, own_n) if self.prompts is not None
                   else self._pool().span(rng, own_n or 0))
            turns.append(Turn(prefix + own, output_n))
        return turns

    def _prefix(self, group: int) -> tuple[int, ...]:
        if group not in self._prefixes:
            rng = random.Random(f"{self.spec.data_seed}{self.tag}:prefix:{group}")
            self._prefixes[group] = self._pool().span(rng, self.spec.prefix_tokens)
        return self._prefixes[group]

    def _pool(self) -> TokenPool:
        if self.pool is None:
            raise DataError("synthetic prompts and shared prefixes are cut from a text: none was given")
        return self.pool


def build_load(spec: LoadSpec, tokenizer: Tokenizer, text: str | None = None, prompts: list[str] | None = None,
               warmup: bool = False) -> Load:
    """The load of `spec` (or its warm-up: `warmup_requests` requests from streams of their own), its prompts cut
    from `text` or taken from `prompts` (a prompts file's), shared prefixes from `text`."""
    pool = TokenPool(tokenizer, text) if text is not None else None
    file = PromptFile(tokenizer, prompts) if prompts is not None else None
    if warmup:
        spec = replace(spec, num_requests=spec.warmup_requests, duration_s=None)
    return Load(spec, pool, file, tag=":warmup" if warmup else "")
