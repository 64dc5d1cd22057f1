"""`weight_candidates`: choose the weights' quantization and the cache kind together, under one memory budget.

    select_weights_and_cache → lookup cache plan (fresh: done, nothing measured)
                             → pair_budget for every (weights, cache kind): weight bytes (estimated from the shapes,
                               equal to the measured ones) + cache bytes at max_seq_len × batch
                             → per weight candidate with a fitting pair: quantize a copy, run_probe per fitting kind,
                               compare with the reference → gate_failures
                             → time the survivors interleaved (each on its own model, on the run's engine, as
                               cache selection does) → fastest → CachePlanStore.put
The reference is the unquantized model with its own-dtype cache (transformers' DynamicCache), as in cache selection; a
candidate is (weights, cache kind). Every pair's row is kept in the cache plan; the key is cache selection's fields plus
the weight candidates, the memory budget and torchao's version, so cache plans without weight_candidates keep their
keys.
Does not print tables or know about manifests (the auto-cache-select step does).
"""

from __future__ import annotations

import copy
from pathlib import Path

from runner.errors import InferenceError
from runner.files import package_version
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.quantization import canonical_quantization
from runner.infer.loading.texts import EvalText, load_text
from runner.infer.measure.quality import compare, run_probe
from runner.infer.measure.timing import Stopwatch
from runner.infer.quant.weights import estimate_weight_bytes, quantize_model, weight_bytes
from runner.infer.select.autocache import (
    MIB,
    Selection,
    cache_plan_fields,
    candidates,
    check_lengths,
    choose_row,
    config_probe,
    gate_failures,
    model_identity,
    planned_selection,
    reference_kind,
    time_survivors,
    within_budget,
)
from runner.infer.select.task_gate import TaskGate
from runner.report import ProgressFactory, no_progress


def select_weights_and_cache(model, tokenizer, config: GenerateConfig, *, batch_size: int,
                             identity: dict | None = None, text: EvalText | None = None, base_dir: Path | None = None,
                             progress: ProgressFactory = no_progress) -> Selection:
    """Choose (weights, cache kind) for the unquantized `model` under `config`'s budgets and gates; reuse a fresh
    cache plan. `Selection.weights` is the chosen quantization, `Selection.kind` the cache kind."""
    watch = Stopwatch()
    text = text or load_text(config.cache_quality_data, base_dir)
    fields = joint_fields(model, config, identity or model_identity(model), batch_size, text)

    def measure_and_choose() -> dict:
        rows = measure_pairs(model, tokenizer, config, batch_size, text, progress)
        weights, kind, source, reason = choose_pair(rows, config, reference_pair(model, config, batch_size))
        return {"weights": weights, "kind": kind, "source": source, "reason": reason, "rows": rows}

    return planned_selection(fields, config, measure_and_choose, watch)


def weight_candidates(config: GenerateConfig) -> list[str]:
    """The weight candidates, canonical (`int4` → `int4:g64`), each once, in the manifest's order."""
    return list(dict.fromkeys(canonical_quantization(q) for q in config.weight_candidates or []))


def pair_budget(model, weights: str, weight_mib: float, kind: str, config: GenerateConfig, batch_size: int) -> dict:
    """A pair's row: its bytes and whether they fit both budgets (the cache's alone, weights + cache)."""
    row = {"weights": weights, **within_budget(model, kind, config, batch_size), "weight_mib": weight_mib}
    row["total_mib"] = weight_mib + row["estimated_mib"]
    if row["fits"] and config.memory_budget_mb is not None and row["total_mib"] > config.memory_budget_mb:
        row.update(fits=False, verdict=f"over memory budget: {row['total_mib']:.1f} MiB > {config.memory_budget_mb:g} "
                                       f"MiB (weights {weight_mib:.1f} + cache {row['estimated_mib']:.1f})")
    return row


def reference_pair(model, config: GenerateConfig, batch_size: int) -> dict:
    """The fallback's row: the unquantized weights with their own-dtype cache."""
    return pair_budget(model, "none", weight_bytes(model) / MIB, reference_kind(model), config, batch_size)


def measure_pairs(model, tokenizer, config: GenerateConfig, batch_size: int, text: EvalText,
                  progress: ProgressFactory = no_progress) -> list[dict]:
    """Budget, quality and speed of every (weights, cache kind) pair; a row says why a pair was dropped."""
    check_lengths(config)
    weight_mib = {w: estimate_weight_bytes(model, w) / MIB for w in weight_candidates(config)}
    rows = [pair_budget(model, w, weight_mib[w], kind, config, batch_size)
            for w in weight_candidates(config) for kind in candidates(config)]
    fitting = [row for row in rows if row["fits"]]
    if not fitting:
        smallest = min(rows, key=lambda r: r["total_mib"])
        raise InferenceError(
            f"no (weights, cache kind) pair fits memory_budget_mb={config.memory_budget_mb} / cache_budget_mb="
            f"{config.cache_budget_mb} at max_seq_len={config.max_seq_len} × batch {batch_size}: the smallest, "
            f"{smallest['weights']} + {smallest['kind']}, needs {smallest['total_mib']:.1f} MiB (weights "
            f"{smallest['weight_mib']:.1f} + cache {smallest['estimated_mib']:.1f}); raise the budget or lower "
            "max_seq_len / batch_size")
    device = next(model.parameters()).device
    probe = config_probe(tokenizer, text, config, device)
    bar = progress("weights × cache quality", len(fitting) + 1, "pair")
    reference = run_probe(model, probe, None)
    tasks = TaskGate(model, tokenizer, config.cache_quality_tasks, progress) if config.cache_quality_tasks else None
    bar.update(note="reference")
    models = {}
    for weights in dict.fromkeys(row["weights"] for row in fitting):
        candidate = model if weights == "none" else quantize_model(copy.deepcopy(model), weights)
        measured_mib = weight_bytes(candidate) / MIB
        group = [r for r in fitting if r["weights"] == weights]
        for row in group:
            metrics = compare(reference, run_probe(candidate, probe, row["kind"]))
            failures = gate_failures(metrics, config)
            row.update(metrics, measured_weight_mib=measured_mib, passed=not failures,
                       measured_mib=metrics["measured_bytes_per_token"] * config.max_seq_len * batch_size / MIB,
                       verdict="; ".join(failures) or "passed gates")
            bar.update(note=f"{weights} + {row['kind']}")
        if tasks is not None:  # the costly gate last, on the cheap gates' survivors only, all at once
            judged = [r for r in group if r["passed"]]
            for row, failures in zip(judged, tasks.judge(candidate, judged)):
                row.update(passed=not failures, verdict="; ".join(failures) or "passed gates")
        if any(r["passed"] for r in fitting if r["weights"] == weights):
            models[weights] = candidate  # kept for the speed pick
        del candidate
    bar.close()
    survivors = [row for row in fitting if row["passed"]]
    time_survivors({label(r): (r, models[r["weights"]]) for r in survivors}, tokenizer, text, config, batch_size)
    return rows


def label(row: dict) -> str:
    return f"{row['weights']} + {row['kind']}"


def choose_pair(rows: list[dict], config: GenerateConfig, reference: dict) -> tuple[str, str, str, str]:
    """(weights, kind, source, reason): cache selection's rule over pairs (the fastest survivor beyond the spread,
    ties by quality then total bytes; the first survivor when benchmarking is off; else the on-fail policy, whose
    fallback is the unquantized model with its own-dtype cache)."""
    row, source, reason = choose_row(rows, config, reference, name=label, what="(weights, cache kind) pair",
                                     bytes_key="total_mib")
    return row["weights"], row["kind"], source, reason


def joint_fields(model, config: GenerateConfig, identity: dict, batch_size: int, text: EvalText) -> dict:
    """Cache selection's fields, plus what only the joint choice depends on."""
    fields = cache_plan_fields(model, config, identity, batch_size, text)
    fields["settings"] |= {"weight_candidates": weight_candidates(config), "memory_budget_mb": config.memory_budget_mb}
    fields["torchao"] = package_version("torchao")
    return fields

