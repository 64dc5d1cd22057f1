"""`cache_kind: auto`: budget filter → quality gates → speed pick → persisted cache plan.

    select_cache_kind → lookup cache plan (fresh: done, nothing measured)
                      → within_budget (estimated bytes at max_seq_len × batch)
                      → run_probe per kind, compare with the reference → gate_failures
                      → time_survivors (time_decode_pairs) → choose → CachePlanStore.put
The survivors are timed on the engine the run decodes with (`engine`: eager, or compiled with its steps compiled
first, the seconds that took in each row's `compile_s`, never in a timing); each row says which (`timed_on`) and
the cache plan's key includes the engine. The reference is the model's own dtype in transformers' DynamicCache. Every
candidate's row (bytes,
ΔNLL, PPL ratio, KL, needle, tokens/s, verdict) is kept in the cache plan. Does not print tables, draw
plots or know about manifests: the auto-cache-select step does that with the rows returned here.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from runner.errors import InferenceError, RunnerError
from runner.infer.cache.layers import STORAGE_DTYPES
from runner.infer.cache.registry import bytes_per_token, estimate_cache_bytes
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.kinds import canonical_kind
from runner.infer.config.quantization import canonical_quantization
from runner.infer.loading.texts import EvalText, load_text, token_windows
from runner.infer.measure.quality import build_probe, compare, run_probe
from runner.infer.measure.timing import Stopwatch, device_name
from runner.infer.select.cache_plans import CachePlanStore, cache_plan_key
from runner.infer.select.speed import compile_pairs, time_decode_pairs
from runner.infer.select.task_gate import TaskGate
from runner.report import ProgressFactory, no_progress

MIB = 1024 * 1024
CACHE_FORMAT = 3  # bump when a quantizer, the probe or the rows change: persisted cache plans then no longer apply
# (2: *_mib; 3: rows say timed_on and compile_s)
# Settings that change the answer, hence part of the cache plan's key (the cache plan path and probe settings do not).
KEYED_SETTINGS = ("cache_candidates", "cache_budget_mb", "cache_quality_max_delta_nll", "cache_quality_max_ppl_ratio",
                  "cache_quality_max_mean_kl", "cache_quality_prompt_len", "cache_quality_decode_steps",
                  "cache_quality_windows", "cache_quality_ppl_len", "cache_quality_on_fail", "cache_auto_benchmark",
                  "cache_auto_tie_break", "cache_quality_tasks",
                  "cache_auto_bench_steps", "cache_auto_bench_prompt_len", "cache_auto_bench_repeats", "max_seq_len",
                  "engine")


@dataclass(frozen=True)
class Selection:
    kind: str  # the cache kind to use
    source: str  # measured (a candidate passed) | gate_failed (none did: the reference kind)
    reused: bool  # taken from a fresh persisted cache plan, nothing measured
    reason: str  # one line a person can read
    rows: list[dict]  # one per candidate, in candidate order
    key: str  # the cache plan's fingerprint: sha256 of `fields`
    fields: dict  # everything that could change the answer (model, device, versions, settings, eval text)
    cache_plan_path: str  # where the cache plan is kept
    seconds: float  # how long the selection took (a reused cache plan: no measurement at all)
    persist_error: str = ""  # why the cache plan could not be saved (the measurements are kept all the same)
    weights: str | None = None  # joint selection (weight_candidates): the chosen weight quantization


def select_cache_kind(model, tokenizer, config: GenerateConfig, *, batch_size: int, identity: dict | None = None,
                      text: EvalText | None = None, base_dir: Path | None = None,
                      progress: ProgressFactory = no_progress) -> Selection:
    """Choose a cache kind for `model` under `config`'s budget and gates, reusing a fresh persisted cache plan."""
    watch = Stopwatch()  # how long the selection took (no device work to sync: the measurements sync their own)
    text = text or load_text(config.cache_quality_data, base_dir)
    fields = cache_plan_fields(model, config, identity or model_identity(model), batch_size, text)

    def measure_and_choose() -> dict:
        rows = measure_candidates(model, tokenizer, config, batch_size, text, progress)
        reference = within_budget(model, reference_kind(model), config, batch_size)
        kind, source, reason = choose(rows, config, reference)
        return {"kind": kind, "source": source, "reason": reason, "rows": rows}

    return planned_selection(fields, config, measure_and_choose, watch)


def planned_selection(fields: dict, config: GenerateConfig, measure_and_choose, watch: Stopwatch) -> Selection:
    """The persisted cache plan of `fields` while fresh (nothing measured); else `measure_and_choose()` → a cache
    plan ({kind, source, reason, rows}, joint selection: weights too), persisted under the fields' key."""
    key, store = cache_plan_key(fields), CachePlanStore(Path(config.cache_plan_path))
    joint = "weight_candidates" in fields["settings"]
    cache_plan, why = store.lookup(key, config.cache_plan_probe, config.cache_plan_probe_interval_sec,
                                   validate=lambda plan: cache_plan_problem(plan, joint))
    if cache_plan is not None:
        return Selection(cache_plan["kind"], cache_plan["source"], True,
                         f"reused cache plan {key[:12]} ({why}): {cache_plan['reason']}", cache_plan["rows"], key,
                         fields, str(store.path), watch.lap(), weights=cache_plan.get("weights"))
    cache_plan = measure_and_choose()
    try:
        store.put(key, cache_plan, fields)
        persist_error = ""
    except RunnerError as exc:  # the measurements stay: the caller records them and says what was not saved
        persist_error = str(exc)
    return Selection(cache_plan["kind"], cache_plan["source"], False,
                     f"{cache_plan['reason']} (cache plan {key[:12]} was {why})", cache_plan["rows"], key, fields,
                     str(store.path), watch.lap(), persist_error, weights=cache_plan.get("weights"))


ROW_NUMBERS = ("estimated_mib", "measured_mib", "delta_nll", "ppl_ratio", "mean_kl", "tokens_per_s",
               "tokens_per_s_spread", "prefill_ms", "weight_mib", "total_mib", "task_score", "task_reference",
               "task_drop")


def cache_plan_problem(plan: dict, joint: bool = False) -> str:
    """What makes a persisted cache plan unfit to reuse ("" when it is fit): a missing or mistyped field, a kind or
    weight quantization this runner does not know, a row it could not report, a measured choice no passing row
    holds. `joint`: a (weights, cache kind) plan."""
    want = {"kind": str, "source": str, "reason": str, "rows": list, **({"weights": str} if joint else {})}
    wrong = [name for name, kind in want.items() if not isinstance(plan.get(name), kind)]
    if wrong:
        return f"{', '.join(wrong)} missing or of the wrong type"
    if plan["source"] not in ("measured", "gate_failed"):
        return f"source {plan['source']!r} is neither 'measured' nor 'gate_failed'"
    try:
        canonical_kind(plan["kind"])  # raises ValueError naming an unknown kind
        for n, row in enumerate(plan["rows"]):
            if not (isinstance(row, dict) and isinstance(row.get("kind"), str) and isinstance(row.get("passed"), bool)
                    and isinstance(row.get("verdict"), str) and (not joint or isinstance(row.get("weights"), str))):
                return f"row {n} lacks kind, passed, verdict{' or weights' if joint else ''}"
            canonical_kind(row["kind"])
            bad = [k for k in ROW_NUMBERS if row.get(k) is not None and (isinstance(row[k], bool)
                                                                          or not isinstance(row[k], (int, float)))]
            if bad:
                return f"row {n}: {', '.join(bad)} not a number"
        for weights in [plan["weights"], *(row["weights"] for row in plan["rows"])] if joint else []:
            canonical_quantization(weights)
    except ValueError as exc:
        return str(exc)
    chosen = [row for row in plan["rows"] if row["kind"] == plan["kind"] and row.get("weights") == plan.get("weights")]
    if plan["source"] == "measured" and not any(row["passed"] for row in chosen):
        return f"the chosen kind {plan['kind']!r} has no passing row"
    return ""


def measure_candidates(model, tokenizer, config: GenerateConfig, batch_size: int, text: EvalText,
                       progress: ProgressFactory = no_progress) -> list[dict]:
    """Budget, quality and speed of every candidate; a row says why a candidate was dropped."""
    check_lengths(config)
    rows = [within_budget(model, kind, config, batch_size) for kind in candidates(config)]
    fitting = [row for row in rows if row["fits"]]
    if not fitting:
        smallest = min(rows, key=lambda r: r["estimated_mib"])
        estimates = ", ".join(f"{r['kind']} {r['estimated_mib']:.1f}" for r in rows)
        raise InferenceError(
            f"no cache kind fits cache_budget_mb={config.cache_budget_mb:g} at max_seq_len={config.max_seq_len} × "
            f"batch {batch_size}: the smallest, {smallest['kind']}, needs {smallest['estimated_mib']:.1f} MiB "
            f"(estimates in MiB: {estimates}); raise the budget or lower max_seq_len / batch_size")
    device = next(model.parameters()).device
    probe = config_probe(tokenizer, text, config, device)
    bar = progress("cache quality", len(fitting) + 1, "kind")
    reference = run_probe(model, probe, None)
    tasks = TaskGate(model, tokenizer, config.cache_quality_tasks, progress) if config.cache_quality_tasks else None
    bar.update(note="reference")
    for row in fitting:
        try:
            metrics = compare(reference, run_probe(model, probe, row["kind"]))
        except torch.OutOfMemoryError as exc:  # this kind only: the others are still measured
            _release(device)
            row.update(passed=False, verdict=f"out of memory: {str(exc).splitlines()[0] if str(exc) else ''}"[:200])
            bar.update(note=row["kind"])
            continue
        except InferenceError as exc:  # e.g. nuq codes for a model load_model did not make: this kind only
            row.update(passed=False, verdict=str(exc)[:200])
            bar.update(note=row["kind"])
            continue
        bar.update(note=row["kind"])
        row.update(metrics, measured_mib=metrics["measured_bytes_per_token"] * config.max_seq_len * batch_size / MIB)
        failures = gate_failures(metrics, config)
        row.update(passed=not failures, verdict="; ".join(failures) or "passed gates")
    bar.close()
    if tasks is not None:  # the costly gate last, on the cheap gates' survivors only, all at once
        judged = [row for row in fitting if row["passed"]]
        for row, failures in zip(judged, tasks.judge(model, judged)):
            row.update(passed=not failures, verdict="; ".join(failures) or "passed gates")
    survivors = [row for row in fitting if row["passed"]]
    time_survivors({row["kind"]: (row, model) for row in survivors}, tokenizer, text, config, batch_size)
    return rows


def time_survivors(survivors: dict[str, tuple[dict, torch.nn.Module]], tokenizer, text: EvalText,
                   config: GenerateConfig, batch_size: int) -> None:
    """Time the gates' survivors (name → (row, model)) interleaved on the run's engine, when cache_auto_benchmark
    asks; each row gets its decode speed, the engine that timed it (`timed_on`) and, compiled, what compiling its
    step took (`compile_s`, measured before and apart from the timing)."""
    if not (config.cache_auto_benchmark and survivors):
        return
    device = next(next(iter(survivors.values()))[1].parameters()).device
    prompt = torch.tensor(token_windows(tokenizer, text, config.cache_auto_bench_prompt_len, 1) * batch_size,
                          device=device)
    pairs = {name: (model, row["kind"]) for name, (row, model) in survivors.items()}
    compile_s = (compile_pairs(pairs, prompt, config.cache_auto_bench_steps, config.max_seq_len)
                 if config.engine == "compiled" else {})
    timings = time_decode_pairs(pairs, prompt, config.cache_auto_bench_steps, config.cache_auto_bench_repeats,
                                engine=config.engine, max_seq_len=config.max_seq_len)
    for name, (row, _) in survivors.items():
        timing = timings[name]
        row.update(tokens_per_s=timing.decode_tokens_per_s.median,
                   tokens_per_s_spread=timing.decode_tokens_per_s.spread, prefill_ms=timing.ttft_s.median * 1e3,
                   timed_on=config.engine)
        if name in compile_s:
            row["compile_s"] = compile_s[name]


def config_probe(tokenizer, text: EvalText, config: GenerateConfig, device: torch.device):
    """The quality probe the cache_quality_* settings describe (its perplexity window capped by max_seq_len)."""
    return build_probe(tokenizer, text, config.cache_quality_prompt_len, config.cache_quality_decode_steps,
                       config.cache_quality_windows, min(config.cache_quality_ppl_len, config.max_seq_len), device)


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def candidates(config: GenerateConfig) -> list[str]:
    """The candidate kinds, aliases resolved, each once, in the manifest's order."""
    return list(dict.fromkeys(canonical_kind(k) for k in config.cache_candidates))


def check_lengths(config: GenerateConfig) -> None:
    """Every probe must fit in max_seq_len; say which setting to change rather than fail inside the model."""
    needs = [("cache_quality_prompt_len + cache_quality_decode_steps + 1",
              config.cache_quality_prompt_len + config.cache_quality_decode_steps + 1),
             ("cache_auto_bench_prompt_len + cache_auto_bench_steps",
              config.cache_auto_bench_prompt_len + config.cache_auto_bench_steps)]
    too_long = [f"{name} = {n}" for name, n in needs if n > config.max_seq_len]
    if too_long:
        raise InferenceError(f"{'; '.join(too_long)} exceed max_seq_len={config.max_seq_len}: lower them or raise "
                        "max_seq_len")


def within_budget(model, kind: str, config: GenerateConfig, batch_size: int) -> dict:
    """The candidate's estimated bytes at max_seq_len × batch (an evicting kind: a prompt of max_seq_len −
    max_new_tokens, pressed, then max_new_tokens more) against cache_budget_mb."""
    per_token = bytes_per_token(model.config, kind, model.dtype)
    prompt_len = max(1, config.max_seq_len - config.max_new_tokens)
    estimated_mib = estimate_cache_bytes(model.config, kind, batch_size, config.max_seq_len, model.dtype,
                                         prompt_len=prompt_len) / MIB
    fits = config.cache_budget_mb is None or estimated_mib <= config.cache_budget_mb
    verdict = "" if fits else f"over budget: {estimated_mib:.1f} MiB > {config.cache_budget_mb:g} MiB"
    return {"kind": kind, "estimated_bytes_per_token": per_token, "estimated_mib": estimated_mib, "fits": fits,
            "passed": False, "verdict": verdict}


def gate_failures(metrics: dict, config: GenerateConfig) -> list[str]:
    """The gates a candidate fails, each with its figure; NaN fails too (`not NaN <= limit`)."""
    gates = [("ΔNLL", metrics["delta_nll"], config.cache_quality_max_delta_nll),
             ("PPL ratio", metrics["ppl_ratio"], config.cache_quality_max_ppl_ratio),
             ("mean KL", metrics["mean_kl"], config.cache_quality_max_mean_kl)]
    return [f"{name} {value:.4g} > {limit:g}" for name, value, limit in gates if not value <= limit]


def choose(rows: list[dict], config: GenerateConfig, reference: dict) -> tuple[str, str, str]:
    """(kind, source, reason): the fastest survivor (or the first, unbenchmarked); else the on-fail policy.

    `reference` is `within_budget`'s row for the model's own dtype: the fallback must fit the budget too.
    """
    row, source, reason = choose_row(rows, config, reference)
    return row["kind"], source, reason


def choose_row(rows: list[dict], config: GenerateConfig, reference: dict, name=lambda r: r["kind"],
               what: str = "cache kind", bytes_key: str = "estimated_mib") -> tuple[dict, str, str]:
    """`choose` for any rows (joint selection: pairs named by `name`, compared on `bytes_key`): (the chosen row, or
    the reference on a gate failure; source; reason)."""
    survivors = [row for row in rows if row["passed"]]
    if not survivors:
        failed = "; ".join(f"{name(r)}: {r['verdict']}" for r in rows)
        if config.cache_quality_on_fail == "error" or not reference["fits"]:
            why = ("cache_quality_on_fail is error" if reference["fits"]
                   else f"the fallback, the reference {name(reference)}, is {reference['verdict']}")
            raise InferenceError(f"no {what} passed the quality gates ({failed}) and {why}; loosen the gates "
                                 "or raise the budget")
        return reference, "gate_failed", f"no candidate passed the gates; using the reference {name(reference)}"
    if config.cache_auto_benchmark:
        _, source, reason = _fastest(survivors, config.cache_auto_tie_break, name, bytes_key)
        return next(row for row in survivors if row["verdict"].startswith("chosen")), source, reason
    best = survivors[0]
    best["verdict"] = "chosen: first passing candidate"
    return best, "measured", f"{name(best)}: first of {len(survivors)} passing (benchmark off)"


def speed_ties(survivors: list[dict]) -> list[dict]:
    """The fastest survivor and every one whose median is within the larger of the two measured spreads of it:
    differences that small are noise on the machine they were measured on."""
    fastest = max(survivors, key=lambda r: r["tokens_per_s"])
    return [row for row in survivors if fastest["tokens_per_s"] - row["tokens_per_s"]
            <= max(fastest.get("tokens_per_s_spread", 0.0), row.get("tokens_per_s_spread", 0.0))]


def _fastest(survivors: list[dict], tie_break: str, name=lambda r: r["kind"],
             bytes_key: str = "estimated_mib") -> tuple[str, str, str]:
    """The fastest beyond the spread; within it, by quality then bytes (or bytes then quality). Marks every row.
    `name` labels a row in the reason (joint selection: weights + kind), `bytes_key` is the bytes compared."""
    ties = speed_ties(survivors)
    quality, size = (lambda r: r.get("delta_nll", math.inf)), (lambda r: r.get(bytes_key, math.inf))
    order = (quality, size) if tie_break == "quality" else (size, quality)
    best = min(ties, key=lambda r: (order[0](r), order[1](r)))
    for row in survivors:
        row["speed_verdict"] = "tied" if row in ties and len(ties) > 1 else "fastest" if row is best else "slower"
        row["verdict"] = ("passed gates, slower" if row not in ties
                          else f"passed gates, tied on speed, worse {tie_break}" if row is not best
                          else "chosen: fastest beyond the spread" if len(ties) == 1
                          else f"chosen: tied on speed within the spread, best {tie_break}")
    if len(ties) == 1:
        return best["kind"], "measured", (f"{name(best)}: fastest of {len(survivors)} passing "
                                          f"({best['tokens_per_s']:.1f} tok/s, beyond the others' spread)")
    tied = ", ".join(f"{name(r)} {r['tokens_per_s']:.1f}±{r.get('tokens_per_s_spread', 0.0):.1f}" for r in ties)
    return best["kind"], "measured", (f"{name(best)}: {len(ties)} candidates tied on speed within the spread "
                                      f"({tied} tok/s); best {tie_break}")


def reference_kind(model) -> str:
    return {dtype: name for name, dtype in STORAGE_DTYPES.items()}[model.dtype]


def cache_plan_fields(model, config: GenerateConfig, identity: dict, batch_size: int, text: EvalText) -> dict:
    """Everything that could change the answer: model, dtype, device, versions, batch, settings, eval text."""
    device = next(model.parameters()).device
    return {
        "model": identity,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch_size": batch_size,
        "settings": {**config.model_dump(mode="json", include=set(KEYED_SETTINGS)),
                     "cache_candidates": candidates(config)},
        "cache_format": CACHE_FORMAT,
        "eval_data": {"name": text.name, "sha256": text.sha256},
    }


def model_identity(model) -> dict:
    """For a bare model (no loader fingerprint): its config, size, and the first 1024 values of every weight
    tensor (a cheap sample: enough to tell checkpoints apart, not a content hash)."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().flatten()[:1024].float().cpu().numpy().tobytes())
    return {"name_or_path": model.config._name_or_path, "weights_sample_sha256": digest.hexdigest(),
            "n_params": sum(p.numel() for p in model.parameters())}
