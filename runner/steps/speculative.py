"""`mode: speculative`: the draft proposes, the target verifies; acceptance and speedup measured in one step.

Owns: the target-only baseline on the same prompts, the predicted speedup and the step's metrics; the draft (or prompt
lookup, and the tokenizer check) and the prompts come from runner.steps.shared. The algorithm itself is
runner.infer.speculative.generator.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from runner.infer.compiled.engine import engine_for
from runner.infer.config.decoding import GenerateConfig, SpeculativeConfig
from runner.infer.generation.generator import Generator
from runner.infer.loading.models import LoadedModel
from runner.infer.measure.timing import on_device, time_once
from runner.infer.select.speed import time_decode_kinds
from runner.infer.speculative.generator import PROMPT_LOOKUP, SpeculativeGenerator
from runner.manifest.blocks import SpeculativeBlock, library_config
from runner.manifest.plan import Step
from runner.report import ProgressFactory, show
from runner.steps.shared import load_draft, load_prompts, step_block

log = logging.getLogger(__name__)


def run_speculative(step: Step, lm: LoadedModel, base_dir: Path, out_dir: Path, progress: ProgressFactory) -> dict:
    block = step_block(SpeculativeBlock, step)
    config = library_config(block, SpeculativeConfig, seed=step.seed)
    assert config.seed is not None  # the step's seed
    draft, draft_tokenizer = load_draft(block, lm, step, base_dir)
    prompts = load_prompts(block, base_dir)
    records, spec_s, base_s, stats = [], 0.0, 0.0, []
    for start in range(0, len(prompts), block.batch_size):
        enc = lm.tokenizer(prompts[start:start + block.batch_size], return_tensors="pt", padding=True).to(lm.device)
        rng = torch.Generator(lm.device).manual_seed(config.seed)
        gen = SpeculativeGenerator(target_model=lm.model, draft_model=draft, config=config, generator=rng,
                                   tokenizer=lm.tokenizer, draft_tokenizer=draft_tokenizer)
        out = gen.generate(enc.input_ids, enc.attention_mask)
        spec_s += gen.stats.seconds
        stats.append(gen.stats.as_dict())
        new = out[:, enc.input_ids.shape[1]:]
        for row, prompt in enumerate(prompts[start:start + block.batch_size]):
            tokens = new[row, : gen.stats.new_tokens[row]].tolist()
            records.append({"prompt": prompt, "output": lm.tokenizer.decode(tokens, skip_special_tokens=True),
                            "token_ids": tokens, "stop_reason": gen.stats.stop_reasons[row]})
        if block.compare_target_only:
            base_s += _target_only_seconds(lm, enc, config)
        log.info("[%s] batch %d: acceptance %.2f, mean accepted %.2f", step.key, start // block.batch_size + 1,
                 gen.acceptance_rate, gen.stats.mean_accepted_length)
    for r in records:
        show(f"\n[{step.key}] {r['prompt']!r} →\n{r['output']}")
    metrics = _metrics(stats, records, spec_s, base_s, _cost_ratio(lm, draft, config), config)
    measured = (f"speedup vs target-only {metrics['speedup']:.2f}×" if "speedup" in metrics
                else "target-only not timed (compare_target_only: false)")
    show(f"[{step.key}] {measured} (predicted {metrics['predicted_speedup']:.2f}×), "
         f"acceptance {metrics['acceptance_rate']:.2f}")
    series = {"spec_k": [k for s in stats for row in s["k_history"] for k in row],  # k per round, rows in turn
              "accepted_length_hist": [sum(h) for h in _padded_hists(stats)]}  # rounds that accepted n (step n)
    return {"prompts": records, "telemetry": stats, "metrics": metrics, "series": series}


def _padded_hists(stats: list[dict]) -> list[tuple[int, ...]]:
    """Per accepted length n: the counts of every batch (histograms of different lengths aligned)."""
    longest = max((len(s["accepted_hist"]) for s in stats), default=0)
    return list(zip(*[s["accepted_hist"] + [0] * (longest - len(s["accepted_hist"])) for s in stats]))


def _target_only_seconds(lm: LoadedModel, enc, config: SpeculativeConfig) -> float:
    """The same prompts and settings decoded by the target alone, with our decode loop."""
    baseline = GenerateConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                              top_k=config.top_k, top_p=config.top_p, max_seq_len=config.max_seq_len,
                              cache_kind=config.cache_kind, seed=config.seed, engine=config.engine)
    if config.engine == "compiled":  # compile the target-only shape now, outside the timing
        engine_for(lm.model).state(config.cache_kind, enc.input_ids.shape[0],
                                   enc.input_ids.shape[1] + config.max_new_tokens, config.max_seq_len)
    return time_once(lambda: Generator(lm.model, config=baseline).generate(enc.input_ids, enc.attention_mask),
                     **on_device(lm.device))


def _cost_ratio(lm: LoadedModel, draft, config: SpeculativeConfig) -> float:
    """c = time of a draft forward / time of a target forward, measured on one decode of 8 steps each."""
    if draft == PROMPT_LOOKUP:
        return 0.0
    prompt = torch.arange(1, 33, device=lm.device)[None]
    kind = config.cache_kind
    target = time_decode_kinds(lm.model, prompt, 8, [kind], repeats=1)[kind].decode_tokens_per_s.median
    drafted = time_decode_kinds(draft, prompt, 8, [kind], repeats=1)[kind].decode_tokens_per_s.median
    return target / drafted


def _metrics(stats: list[dict], records: list[dict], spec_s: float, base_s: float, cost: float,
             config: SpeculativeConfig) -> dict:
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    rounds = sum(s["rounds"] for s in stats)
    alpha = accepted / drafted if drafted else 0.0
    k = drafted / rounds if rounds else config.spec_k  # the mean drafted per round (adaptive k moves it)
    tokens_per_call = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1  # Leviathan et al.
    new_tokens = sum(len(r["token_ids"]) for r in records)
    metrics = {
        "acceptance_rate": alpha,
        "mean_accepted_length": accepted / rounds if rounds else 0.0,
        "draft_forwards": sum(s["draft_forwards"] for s in stats),
        "target_forwards": sum(s["target_forwards"] for s in stats),
        "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / spec_s if spec_s > 0 else 0.0,
        "draft_cost_ratio": cost,
        "mean_k": k,
        "predicted_speedup": tokens_per_call / (k * cost + 1),
    }
    if base_s > 0:
        metrics.update(target_only_s=base_s, speculative_s=spec_s, speedup=base_s / spec_s)
    return metrics
