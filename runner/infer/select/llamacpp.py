"""`cache_kind: auto` on `engine: llama.cpp`: the same budget → gates → speed → persisted plan as autocache.py, with
every figure from llama.cpp itself.

    candidates      the cache_candidates llama.cpp stores (fp32, fp16, bf16, q8_0, q4_0, q4_1); the others are rows
                    that say why they were dropped
    budget          llama.cpp's bytes per token of each type × max_seq_len
    gates           the probe of measure/quality.py (teacher-forced decode steps, a perplexity window, a needle) run
                    through llama.cpp's cache: ΔNLL, PPL ratio and KL against llama.cpp's own f32 K/V
    speed           greedy decode on llama.cpp, the candidates interleaved by the one timing harness
    plan            persisted like ours, keyed by the GGUF's sha256 and `engine: llama.cpp`
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runner.errors import InferenceError
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.llamacpp import GGML_BYTES, GGML_NAMES, kind_refusal
from runner.infer.llamacpp.engine import LlamaCppEngine
from runner.infer.llamacpp.install import installed_version
from runner.infer.loading.pinned import sha256_file
from runner.infer.loading.texts import EvalText, load_text, token_windows
from runner.infer.measure.quality import Probe, ProbeRun, compare
from runner.infer.measure.timing import Stopwatch, TokenTiming, time_interleaved
from runner.infer.select.autocache import (
    CACHE_FORMAT,
    KEYED_SETTINGS,
    MIB,
    Selection,
    candidates,
    check_lengths,
    choose,
    config_probe,
    gate_failures,
    planned_selection,
)
from runner.report import ProgressFactory, no_progress

REFERENCE = "fp32"  # llama.cpp's K/V in f32: the gates' reference


def select_llamacpp_kind(gguf: Path, tokenizer, config: GenerateConfig, *, text: EvalText | None = None,
                         base_dir: Path | None = None, progress: ProgressFactory = no_progress) -> Selection:
    """Choose llama.cpp's K/V type for `gguf` under `config`'s budget and gates, reusing a fresh persisted plan."""
    watch = Stopwatch()
    text = text or load_text(config.cache_quality_data, base_dir)
    fields = {"model": {"gguf": Path(gguf).name, "sha256": sha256_file(Path(gguf))}, "engine": "llama.cpp",
              "llama_cpp_python": installed_version(), "batch_size": 1, "cache_format": CACHE_FORMAT,
              "settings": {**config.model_dump(mode="json", include={*KEYED_SETTINGS, "llamacpp"}),
                           "cache_candidates": candidates(config)},
              "eval_data": {"name": text.name, "sha256": text.sha256}}

    def measure_and_choose() -> dict:
        rows = measure_llamacpp_candidates(gguf, tokenizer, config, text, progress)
        reference = next((r for r in rows if r["kind"] == REFERENCE), None) or budget_row(gguf, REFERENCE, config)
        kind, source, reason = choose(rows, config, reference)
        return {"kind": kind, "source": source, "reason": reason, "rows": rows}

    return planned_selection(fields, config, measure_and_choose, watch)


def budget_row(gguf: Path, kind: str, config: GenerateConfig, per_token: float | None = None) -> dict:
    if per_token is None:
        per_token = _engine(gguf, kind, config, 8).kv_bytes(1)
    estimated_mib = per_token * config.max_seq_len / MIB
    fits = config.cache_budget_mb is None or estimated_mib <= config.cache_budget_mb
    return {"kind": kind, "estimated_bytes_per_token": per_token, "estimated_mib": estimated_mib, "fits": fits,
            "passed": False, "verdict": "" if fits else f"over budget: {estimated_mib:.1f} MiB > "
                                                        f"{config.cache_budget_mb:g} MiB"}


def measure_llamacpp_candidates(gguf: Path, tokenizer, config: GenerateConfig, text: EvalText,
                                progress: ProgressFactory = no_progress) -> list[dict]:
    """Budget, quality and speed of every candidate on llama.cpp; a row says why a candidate was dropped."""
    check_lengths(config)
    probe = config_probe(tokenizer, text, config, torch.device("cpu"))
    reference_engine = _engine(gguf, REFERENCE, config, probe.ppl_ids.shape[1] + 8)  # budgets every type, then gates
    f32_per_token = reference_engine.kv_bytes(1)
    rows: list[dict] = []
    for kind in candidates(config):
        if reason := kind_refusal(kind):
            rows.append({"kind": kind, "fits": False, "passed": False, "verdict": reason})
            continue
        rows.append(budget_row(gguf, kind, config, f32_per_token * GGML_BYTES[kind] / GGML_BYTES[REFERENCE]))
    fitting = [row for row in rows if row["fits"]]
    if not fitting:
        raise InferenceError(f"no candidate llama.cpp stores fits cache_budget_mb={config.cache_budget_mb} at "
                             f"max_seq_len={config.max_seq_len}: {'; '.join(r['verdict'] for r in rows)}")
    bar = progress("cache quality (llama.cpp)", len(fitting) + 1, "kind")
    reference = probe_llamacpp(reference_engine, probe)
    bar.update(note=f"reference {GGML_NAMES[REFERENCE]}")
    for row in fitting:
        metrics = compare(reference, probe_llamacpp(_engine(gguf, row["kind"], config,
                                                            probe.ppl_ids.shape[1] + 8), probe))
        row.update(metrics, measured_mib=metrics["measured_bytes_per_token"] * config.max_seq_len / MIB)
        failures = gate_failures(metrics, config)
        row.update(passed=not failures, verdict="; ".join(failures) or "passed gates")
        bar.update(note=row["kind"])
    bar.close()
    survivors = [row for row in fitting if row["passed"]]
    if config.cache_auto_benchmark and survivors:
        time_llamacpp(gguf, survivors, tokenizer, text, config)
    return rows


def time_llamacpp(gguf: Path, survivors: list[dict], tokenizer, text: EvalText, config: GenerateConfig) -> None:
    """Greedy decode of each survivor on llama.cpp, interleaved by the one harness; rows get tokens/s."""
    prompt = token_windows(tokenizer, text, config.cache_auto_bench_prompt_len, 1)[0]
    length = config.cache_auto_bench_prompt_len + config.cache_auto_bench_steps + 1
    engines = {row["kind"]: _engine(gguf, row["kind"], config, length, logits_all=False) for row in survivors}
    variants = {kind: engine.timed_greedy(prompt, config.cache_auto_bench_steps) for kind, engine in engines.items()}
    marks = time_interleaved(variants, config.cache_auto_bench_repeats)
    for row in survivors:
        timing = TokenTiming.of(marks[row["kind"]], 1)
        row.update(tokens_per_s=timing.decode_tokens_per_s.median,
                   tokens_per_s_spread=timing.decode_tokens_per_s.spread, prefill_ms=timing.ttft_s.median * 1e3,
                   timed_on="llama.cpp")


def probe_llamacpp(engine: LlamaCppEngine, probe: Probe) -> ProbeRun:
    """measure/quality.py's probe through llama.cpp's cache: prefill, then one token at a time (K/V read back
    from llama.cpp's cache at its type); the perplexity window in pieces of `batch` tokens."""
    P = probe.prompt_len
    windows = probe.windows.tolist()
    steps = [_teacher_forced(engine, ids, P, score_prefill=False) for ids in windows]
    step_logprobs = torch.stack(steps)  # [W, S, V]
    targets = probe.windows[:, P + 1:, None]
    step_nll = float(-step_logprobs.gather(-1, targets).mean())
    ppl = probe.ppl_ids[0].tolist()
    logits = torch.from_numpy(engine.logits(ppl))
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    ppl_nll = float(-logprobs.gather(-1, torch.tensor(ppl[1:])[:, None]).mean())
    needle = probe.needle_ids[0].tolist() + probe.answer_ids.tolist()
    needle_logprobs = _teacher_forced(engine, needle, probe.needle_ids.shape[1], score_prefill=True)
    found = bool((needle_logprobs.argmax(-1) == probe.answer_ids).all())
    return ProbeRun(step_logprobs, step_nll, ppl_nll, needle_logprobs, found, float(engine.kv_bytes(1)))


def _teacher_forced(engine: LlamaCppEngine, ids: list[int], prompt_len: int, score_prefill: bool) -> torch.Tensor:
    """measure/quality.teacher_forced_logprobs on llama.cpp: [T-P-1, V] (with the prefill's row: [T-P, V])."""
    engine.reset()
    scored = [engine.feed(ids[:prompt_len]).copy()]
    for pos in range(prompt_len, len(ids) - 1):
        scored.append(engine.feed([ids[pos]]).copy())
    rows = scored if score_prefill else scored[1:]
    return torch.log_softmax(torch.from_numpy(np.stack(rows)).float(), dim=-1)


def _engine(gguf: Path, kind: str, config: GenerateConfig, n_ctx: int, logits_all: bool = True) -> LlamaCppEngine:
    return LlamaCppEngine(gguf, kind=kind, n_ctx=max(n_ctx, 16), options=config.llamacpp, logits_all=logits_all)

