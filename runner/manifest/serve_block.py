"""The `serve` block (mode: serve): a load of requests arriving over time, served by continuous batching, and what
it is measured against: the load (arrivals, lengths, prefixes, turns, seeds), the SLO, the scheduler's limits and
the axes and baselines. The library's meaning of each key is runner.infer.serve (load.py, metrics.py); docs/serve.md.

A check that concerns one key of the block raises ValueAt, so it is reported at that key (file, line, key path).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from runner.errors import ValueAt
from runner.infer.config.kinds import compiled_serve_reason, parse_kind
from runner.infer.config.quantization import check_quantizations
from runner.infer.loading.zoo import zoo_entry
from runner.infer.serve.load import DEFAULT_PROMPT, Lengths, LoadSpec
from runner.infer.serve.metrics import PERCENTILES, Slo
from runner.manifest.blocks import MAX_SEED, ModelBlock, Strict, no_baseline

MAX_TOKENS = 1_000_000
Count = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
Rate = Annotated[float, Field(gt=0, le=1_000_000, allow_inf_nan=False)]  # requests per second
Percentile = Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)]
Milliseconds = Annotated[float, Field(gt=0, le=86_400_000, allow_inf_nan=False)]


class LengthsBlock(Strict):
    """Token counts per request: an integer (that many, always) or a distribution."""

    dist: Literal["fixed", "uniform", "normal"] = Field(description=(
        "fixed (value), uniform over [min, max] inclusive, or normal (mean, std) rounded and clipped to [min, max] "
        "(min 1 and max mean + 4 std unless given)."))
    value: Count | None = Field(None, description="The count of dist: fixed.")
    min: Count | None = Field(None, description="Smallest count (uniform; normal's clip).")
    max: Count | None = Field(None, description="Largest count (uniform; normal's clip).")
    mean: float | None = Field(None, gt=0, le=MAX_TOKENS, allow_inf_nan=False, description="Mean of dist: normal.")
    std: float | None = Field(None, ge=0, le=MAX_TOKENS, allow_inf_nan=False, description="Std of dist: normal.")

    @model_validator(mode="before")
    @classmethod
    def _count_alone(cls, data):
        """`prompt_tokens: 256` means `{dist: fixed, value: 256}`."""
        if isinstance(data, bool):
            raise ValueError("expected a token count or a distribution, not a boolean")
        return {"dist": "fixed", "value": data} if isinstance(data, int) else data

    @model_validator(mode="after")
    def _drawable(self) -> LengthsBlock:
        if problem := self.lengths().problem():
            raise ValueError(problem)
        return self

    def lengths(self) -> Lengths:
        return Lengths(self.dist, self.value, self.min, self.max, self.mean, self.std)


class SloBlock(Strict):
    """Latency bounds a request must meet to count in goodput (any subset), and the percentile a rate must meet them
    at to count as sustained."""

    ttft_ms: Milliseconds | None = Field(None, description="Time to first token, from the scheduled arrival.")
    tpot_ms: Milliseconds | None = Field(None, description="Time per output token after the first.")
    e2e_ms: Milliseconds | None = Field(None, description="From the scheduled arrival to the last token.")
    percentile: Percentile = Field(90, description=(
        "A rate meets the SLO when this percentile of each bounded latency is within its bound and no request was "
        "refused or failed."))

    def slo(self) -> Slo:
        return Slo(self.ttft_ms, self.tpot_ms, self.e2e_ms, self.percentile)


class EndpointBlock(Strict):
    """An OpenAI-compatible server the same load is sent to over HTTP: already running at `url`, or started by
    `launch` for the step and stopped after it."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$", description=(
        "The system's name in the tables and plots (letters, digits, . _ -)."))
    url: str = Field(description="Its base URL, e.g. http://127.0.0.1:8000 (a /v1 suffix is optional).")
    model: str = Field(min_length=1, description="The model name the server lists at /v1/models.")
    api: Literal["completions", "chat"] = Field("completions", description=(
        "completions (/v1/completions) or chat (/v1/chat/completions, the prompt as one user message)."))
    prompt_format: Literal["text", "token_ids"] = Field("text", description=(
        "Send each prompt as text (decoded by this run's tokenizer) or as its token ids (a server with the same "
        "vocabulary)."))
    suppress_eos: bool = Field(False, description=(
        "Add a logit bias of -100 on this run's EOS ids, for servers that ignore min_tokens/ignore_eos (llama.cpp's); "
        "only for a server with the same vocabulary."))
    launch: list[str] | None = Field(None, min_length=1, description=(
        "A command (a list of arguments, no shell) that starts the server; runner waits until `url` lists `model`, "
        "runs the points, then stops it (SIGINT). Placeholders: {python} (runner's python), {gguf:NAME} (a zoo "
        "model's GGUF file), {manifest_dir}."))
    launch_timeout_s: float = Field(300, gt=0, le=3600, allow_inf_nan=False, description=(
        "Seconds a launched server may take to answer."))

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", value):
            raise ValueError(f"expected an http:// or https:// URL such as http://127.0.0.1:8000 (got {value!r})")
        return value

    @field_validator("launch")
    @classmethod
    def _known_placeholders(cls, values: list[str] | None) -> list[str] | None:
        for arg in values or []:
            for name in re.findall(r"\{([^{}]*)\}", arg):
                if name not in ("python", "manifest_dir") and not name.startswith("gguf:"):
                    raise ValueError(f"unknown placeholder {{{name}}} in {arg!r}: {{python}}, {{gguf:NAME}} "
                                     "or {manifest_dir}")
                if name.startswith("gguf:"):
                    zoo_entry("zoo:" + name.removeprefix("gguf:"))  # ValueError names the zoo's models
        return values


class ServeBlock(Strict):
    """The `serve` block: the load, the SLO, the scheduler's limits, axes and baselines. Lists take one value too."""

    arrival: Literal["poisson", "gamma", "constant", "concurrency"] = Field("poisson", description=(
        "How requests arrive: poisson, gamma (with burstiness), constant (evenly spaced), or concurrency (a closed "
        "loop of N users, each sending its next request when the last finished)."))
    rate: list[Rate] | None = Field(None, min_length=1, description=(
        "Requests per second (open loop); a list is a rate sweep, each rate a point."))
    burstiness: float = Field(1.0, gt=0, le=1000, allow_inf_nan=False, description=(
        "Gamma arrivals' shape: 1 is Poisson, below 1 burstier, above 1 more regular."))
    concurrency: int | None = Field(None, ge=1, le=100_000, description="Users of the closed loop.")
    num_requests: int | None = Field(None, ge=1, le=10_000_000, description=(
        "Requests per point (conversations, with turns); default 100 unless duration_s is given."))
    duration_s: float | None = Field(None, gt=0, le=604_800, allow_inf_nan=False, description=(
        "Seconds of arrivals per point, instead of num_requests."))
    warmup_requests: int = Field(0, ge=0, le=100_000, description=(
        "Requests served before each point's clock starts, excluded from the metrics."))
    prompt_tokens: LengthsBlock | None = Field(None, description=(
        "Prompt tokens per request, exact; default 128, or a prompts file's prompts whole."))
    output_tokens: LengthsBlock = Field(LengthsBlock(dist="fixed", value=128), description=(
        "Output tokens per request, exact (EOS ignored until then); default 128."))
    prompts_file: str | None = Field(None, json_schema_extra={"input_file": "prompts"}, description=(
        "Prompts instead of cut text: .txt (one a line) or .jsonl ({\"prompt\": ...}), used in turn, each cut to "
        "its drawn prompt_tokens."))
    data: str = Field("pydoc", min_length=1, json_schema_extra={"input_file": "text"}, description=(
        "Text synthetic prompts and shared prefixes are cut from: pydoc, shakespeare, britannica, a .txt file or "
        "hf:OWNER/REPO/PATH."))
    prefix_groups: int = Field(0, ge=0, le=100_000, description=(
        "Groups of requests sharing their first prefix_tokens (request i is in group i mod G); 0: none."))
    prefix_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="Tokens a group's requests share at the start.")
    turns: int = Field(1, ge=1, le=1000, description=(
        "Turns per conversation: turn t+1's prompt is turn t's prompt, its output and new user tokens."))
    arrival_seed: int = Field(0, ge=0, le=MAX_SEED, description="Seeds the arrival times.")
    data_seed: int = Field(0, ge=0, le=MAX_SEED, description="Seeds the lengths and the text cut for prompts.")
    slo: SloBlock | None = Field(None, description="Latency bounds for goodput and the rate sweep's verdict.")
    percentiles: list[Percentile] = Field(list(PERCENTILES), min_length=1, description=(
        "Latency percentiles reported (linear interpolation, as numpy's default)."))
    max_batch_size: int = Field(16, ge=1, le=4096, description=(
        "Most requests decoding together (continuous batching and the static baseline)."))
    max_wait_ms: float = Field(20, ge=0, le=3_600_000, allow_inf_nan=False, description=(
        "Static baseline: how long a batch waits to fill before it starts."))
    kv_budget_mib: float | None = Field(None, gt=0, le=16_777_216, allow_inf_nan=False, description=(
        "KV-cache memory for all running requests, in MiB (turned into blocks per cache kind)."))
    kv_blocks: int | None = Field(None, ge=1, le=100_000_000, description="KV-cache blocks, instead of kv_budget_mib.")
    block_size: int = Field(16, ge=1, le=4096, description="Tokens per KV block.")
    max_tokens_per_step: int = Field(512, ge=1, le=MAX_TOKENS, description=(
        "Tokens one scheduler step may process (chunked prefill mixed with decoding)."))
    prefix_caching: bool = Field(False, description=(
        "Our scheduler reuses the full prompt blocks a new request shares with a running or finished one instead of "
        "prefilling them: the eager engine's pool stores them once, the compiled slots copy them into the row; "
        "transformers' baseline shares its blocks. Not for KIVI kinds."))
    prefix_cache_blocks: int = Field(512, ge=0, le=100_000_000, description=(
        "prefix_caching: most KV blocks of finished requests' prompts kept for later ones (within the KV budget, "
        "dropped least recently used first when requests need the blocks)."))
    max_queue: int | None = Field(None, ge=1, le=10_000_000, description=(
        "Most requests waiting; beyond it a request is refused (counted), never held forever. Default: unbounded."))
    cache_kinds: list[str] | None = Field(None, min_length=1, description=(
        "KV-cache kinds, an axis (as in bench); default: the model's dtype."))
    quantizations: list[str] | None = Field(None, min_length=1, description=(
        "Weight quantizations, an axis (as in bench: none, int8, int8-dynamic, int4, int4:g32, gguf, ...; the model "
        "is loaded again for each, and every system but the endpoints serves on it); default: the target's."))
    engines: list[Literal["eager", "compiled"]] = Field(["eager"], description=(
        "Engines our continuous batching runs on, an axis: eager (each request its own cache) and compiled (one "
        "static cache whose rows are the requests, one compiled decode step, compiled before the load; KIVI kinds "
        "without sinks: a request joins when its first token can start a block)."))
    speculative: list[Literal["none", "prompt-lookup", "draft"]] = Field(["none"], description=(
        "Speculative decoding in our eager continuous batching, an axis: none (system ours), prompt-lookup (system "
        "ours-lookup: each greedy request drafts up to spec_k tokens from its own prompt and output, verified in "
        "the step's one forward), draft (system ours-draft: the draft model proposes spec_k tokens for every greedy "
        "request in batched forwards of its own); sampled requests decode a token a step. Not on the compiled "
        "engine, not KIVI."))
    spec_k: int = Field(4, ge=1, le=64, description="Most tokens a request drafts a step (speculative).")
    draft: ModelBlock | None = Field(None, description=(
        "The draft model of speculative: draft, sharing the target's tokenizer (its KV cache is outside "
        "kv_budget_mib)."))
    baselines: list[Literal["static", "transformers", "none"]] = Field(["static", "transformers"], description=(
        "Served on the same requests beside continuous batching: static (fixed batches of max_batch_size, after "
        "max_wait_ms), transformers (its own continuous batching, generate_batch); none = no baseline."))
    endpoints: list[EndpointBlock] = Field([], description=(
        "OpenAI-compatible servers sent the same load over HTTP (ours by `run serve`, llama.cpp's, vLLM's), each a "
        "system of the table; `engines: []` with `baselines: [none]` sends the load to them alone."))

    @field_validator("prompts_file")
    @classmethod
    def _prompts_suffix(cls, value: str | None) -> str | None:
        if value is not None and Path(value).suffix not in {".txt", ".jsonl"}:
            raise ValueError("'prompts_file' must end in .txt (one prompt per line) or .jsonl")
        return value

    @field_validator("cache_kinds")
    @classmethod
    def _known_kinds(cls, values: list[str] | None) -> list[str] | None:
        for kind in values or []:
            parse_kind(kind)  # ValueError names the known kinds
        return values

    @field_validator("quantizations")
    @classmethod
    def _known_quantizations(cls, values: list[str] | None) -> list[str] | None:
        return check_quantizations(values)

    @field_validator("engines")
    @classmethod
    def _distinct_engines(cls, values: list[str]) -> list[str]:
        if len(set(values)) != len(values):
            raise ValueError(f"each engine once (got {values})")
        return values


    @field_validator("baselines")
    @classmethod
    def _none_is_no_baseline(cls, values: list[str]) -> list[str]:
        return no_baseline(values)

    @model_validator(mode="after")
    def _a_load_that_can_be_drawn(self) -> ServeBlock:
        closed = self.arrival == "concurrency"
        if closed and self.concurrency is None:
            raise ValueAt(("arrival",), "arrival concurrency needs concurrency: N (the users of the closed loop)")
        if closed and self.rate is not None:
            raise ValueAt(("rate",), "arrival concurrency sends a request when one finishes: remove rate, or use an "
                                     "open-loop arrival (poisson, gamma, constant)")
        if not closed and self.rate is None:
            raise ValueAt(("arrival",), f"arrival {self.arrival} needs a rate (requests per second), e.g. rate: 2 "
                                        "or rate: [1, 2, 4]")
        if not closed and self.concurrency is not None:
            raise ValueAt(("concurrency",), "concurrency is the users of a closed loop: set arrival: concurrency, or "
                                            "remove it")
        if self.burstiness != 1.0 and self.arrival != "gamma":
            raise ValueAt(("burstiness",), f"burstiness shapes gamma arrivals: set arrival: gamma (got arrival "
                                           f"{self.arrival})")
        if self.num_requests is not None and self.duration_s is not None:
            raise ValueAt(("duration_s",), "give num_requests or duration_s, not both")
        if self.kv_budget_mib is not None and self.kv_blocks is not None:
            raise ValueAt(("kv_blocks",), "give kv_budget_mib or kv_blocks, not both")
        for way in {"prompt-lookup", "draft"} & set(self.speculative):
            if "eager" not in self.engines:
                raise ValueAt(("speculative",), f"speculative: {way} runs on the eager engine: add eager to "
                                                f"engines (got {self.engines})")
        if "draft" in self.speculative and self.draft is None:
            raise ValueAt(("speculative",), "speculative: draft needs the draft model: add draft: {id: zoo:NAME} "
                                            "(a model sharing the target's tokenizer)")
        if self.draft is not None and "draft" not in self.speculative:
            raise ValueAt(("draft",), "a draft model serves only with speculative: draft: add draft to speculative "
                                      f"(got {self.speculative}), or remove draft")
        if len(set(self.speculative)) != len(self.speculative):
            raise ValueAt(("speculative",), f"each setting once (got {self.speculative})")
        taken = {"ours", "ours-compiled", "ours-lookup", "ours-draft", "static", "transformers"}
        for i, endpoint in enumerate(self.endpoints):
            if endpoint.name in taken:
                raise ValueAt(("endpoints", i, "name"), f"endpoint name {endpoint.name!r} is taken (by one of ours, a "
                                                        "baseline or an endpoint above): give each a name of its own")
            taken.add(endpoint.name)
        if not self.engines and not self.endpoints:
            raise ValueAt(("engines",), "engines is empty and there are no endpoints: nothing would serve the load")
        self._prefix_fits()
        self._compiled_has_a_kind()
        return self

    def _compiled_has_a_kind(self) -> None:
        """engines: [compiled] alone with only kinds it cannot serve would run nothing of ours: said here."""
        kinds: list[str | None] = [*self.cache_kinds] if self.cache_kinds else [None]
        reasons = [compiled_serve_reason(kind) for kind in kinds]
        if self.engines == ["compiled"] and all(reasons):
            raise ValueAt(("engines",), f"engine compiled serves none of cache_kinds {self.cache_kinds}: "
                                        f"{reasons[0]}; add a kind without sinks (fp16, q8_0, kivi4, ...) or "
                                        "engine eager")

    def _prefix_fits(self) -> None:
        if bool(self.prefix_groups) != bool(self.prefix_tokens):
            raise ValueAt(("prefix_tokens" if self.prefix_groups else "prefix_groups",),
                          "prefix_groups and prefix_tokens go together: give both, or neither")
        lengths = self.prompt_lengths()
        if self.prefix_tokens and lengths is not None and self.prefix_tokens >= lengths.low:
            raise ValueAt(("prefix_tokens",), f"prefix_tokens {self.prefix_tokens} must be below every prompt's "
                                              f"length, but prompt_tokens may draw {lengths.low}")

    def prompt_lengths(self) -> Lengths | None:
        """The prompt lengths drawn: prompt_tokens, else 128; None for a prompts file's prompts whole."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens.lengths()
        return None if self.prompts_file is not None else DEFAULT_PROMPT

    def load_specs(self) -> list[LoadSpec]:
        """One LoadSpec per point (per rate; a closed loop has one)."""
        common: dict[str, Any] = dict(
            arrival=self.arrival, burstiness=self.burstiness, concurrency=self.concurrency,
            num_requests=self.num_requests if self.duration_s is None else None, duration_s=self.duration_s,
            warmup_requests=self.warmup_requests, output_tokens=self.output_tokens.lengths(),
            prompt_tokens=self.prompt_tokens.lengths() if self.prompt_tokens is not None else None,
            prefix_groups=self.prefix_groups, prefix_tokens=self.prefix_tokens, turns=self.turns,
            arrival_seed=self.arrival_seed, data_seed=self.data_seed)
        if self.num_requests is None and self.duration_s is None:
            common["num_requests"] = 100
        rates: list[float | None] = list(self.rate) if self.rate else [None]
        return [LoadSpec(rate=rate, **common) for rate in rates]
