"""`mode: generate`: prompts → text, batched, optionally streamed, with timings per prompt.

Owns batching, what is shown (runner.report) and the step's result dict; prompts are read, and `cache_kind: auto`
chosen, by runner.steps.shared. Decoding itself is runner.infer.generation.generator; where results are written is
the executor's business.
"""

from __future__ import annotations

import csv
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from runner.errors import StepError
from runner.infer.compiled.engine import engine_for
from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.forward import eos_ids
from runner.infer.generation.generator import Generator
from runner.infer.llamacpp.engine import LlamaCppEngine
from runner.infer.loading.models import LoadedModel
from runner.manifest.blocks import GenerateBlock, library_config
from runner.manifest.plan import Step
from runner.report import Progress, ProgressFactory, show, stream
from runner.steps.shared import describe_selection, load_prompts, select_for, selection_params, step_block, step_gguf

log = logging.getLogger(__name__)


def run_generate(step: Step, lm: LoadedModel, base_dir: Path, out_dir: Path, progress: ProgressFactory) -> dict:
    block = step_block(GenerateBlock, step)
    configs = block.strategy_configs(seed=step.seed)
    extra = {}
    if any(config.cache_kind == "auto" for config in configs.values()):
        selection_config = library_config(block, GenerateConfig, seed=step.seed)
        selection = select_for(step, block, selection_config, lm, base_dir, out_dir, progress)
        configs = {name: config.model_copy(update={"cache_kind": selection.kind}) for name, config in configs.items()}
        extra = {"cache_selection": describe_selection(selection), "params": selection_params(selection)}
    prompts = load_prompts(block, base_dir)
    gguf = step_gguf(step, lm, base_dir) if any(c.engine == "llama.cpp" for c in configs.values()) else None

    def decode(config: GenerateConfig, label: str) -> dict:
        if config.engine == "llama.cpp":
            assert gguf is not None
            return _decode_llamacpp(block, config, prompts, lm, gguf, label, progress)
        return _decode_all(block, config, prompts, lm, label, progress)

    if not block.strategies:
        return {**decode(configs[""], step.key), **extra}
    results = {name: decode(config, f"{step.key}/{name}") for name, config in configs.items()}
    side_by_side = [{"prompt": prompt, "outputs": {name: r["prompts"][i]["output"] for name, r in results.items()}}
                    for i, prompt in enumerate(prompts)]
    _write_outputs_csv(out_dir / "outputs.csv", side_by_side)
    metrics = {f"{name}.{key}": value for name, r in results.items() for key, value in r["metrics"].items()}
    return {"prompts": side_by_side, "strategies": results, "metrics": metrics, **extra}


def _decode_all(block: GenerateBlock, config: GenerateConfig, prompts: list[str], lm: LoadedModel, label: str,
                progress: ProgressFactory) -> dict:
    """Every prompt through one decoding configuration: records, totals and the decode plans that applied."""
    assert config.seed is not None  # the step's seed (strategy_configs(seed=step.seed))
    rng = torch.Generator(lm.device).manual_seed(config.seed)
    before = engine_for(lm.model).stats.reading() if config.engine == "compiled" else None
    bar = None if block.stream else progress(label, len(prompts) * config.max_new_tokens, "tok")
    records, batches, plans = [], [], []
    for start in range(0, len(prompts), block.batch_size):
        batch = prompts[start:start + block.batch_size]
        generator = Generator(lm.model, config=config, tokenizer=lm.tokenizer, generator=rng)
        with warnings.catch_warnings():  # the plan is printed below, once per distinct plan
            warnings.simplefilter("ignore")
            if config.num_beams > 1:
                assert bar is not None  # a streaming block (no bar) has no beams: its validator
                records += _beam_batch(generator, lm.tokenizer, batch, config, bar)
            elif block.stream:
                records += _stream_one(generator, lm.tokenizer, batch[0], config)
            else:
                assert bar is not None  # not streaming
                records += _generate_batch(generator, lm.tokenizer, batch, config, bar)
        plan = generator.stats.plan
        if plan is not None and plan.decode_plan != "none" and plan.as_dict() not in plans:
            log.info("[%s] %s", label, plan.describe())
            plans.append(plan.as_dict())
        batches.append({"prefill_s": generator.stats.prefill_s, "decode_s": generator.stats.decode_s})
    if bar is not None:
        bar.close()
        for r in records:
            show(f"\n[{label}] {r['prompt']!r} →\n{r['output']}")
    result: dict[str, Any] = {"prompts": records, "metrics": _totals(records, batches)}
    if before is not None:  # this step's compiling, never inside prefill_s / decode_s: it is reported apart
        seconds, compiles, recompiles = (now - then for now, then in zip(engine_for(lm.model).stats.reading(), before))
        result["compile"] = {"seconds": seconds, "compiles": compiles, "recompiles": recompiles}
        result["metrics"] |= {"compile_s": seconds, "recompiles": float(recompiles)}
    if plans:
        result["decode_plans"] = plans
        result["metrics"]["sliding_window"] = float(any(p["local_window"] for p in plans))
    return result


def _decode_llamacpp(block: GenerateBlock, config: GenerateConfig, prompts: list[str], lm: LoadedModel, gguf: Path,
                     label: str, progress: ProgressFactory) -> dict:
    """Every prompt through llama.cpp, one at a time (llama-cpp-python decodes one sequence): the same tokens in,
    the same record out as our engines."""
    engine = LlamaCppEngine(gguf, kind=config.cache_kind, n_ctx=config.max_seq_len, options=config.llamacpp,
                            seed=config.seed or 0)
    log.info("[%s] llama.cpp on %s: K/V %s, flash attention %s", label, gguf.name, engine.describe()["type_k"],
             "on" if engine.flash_attn else "off")
    eos = frozenset(eos_ids(lm.model, config.eos_token_id))
    bar = None if block.stream else progress(label, len(prompts) * config.max_new_tokens, "tok")
    records, batches = [], []
    for prompt in prompts:
        ids = lm.tokenizer(prompt).input_ids
        if len(ids) + config.max_new_tokens > config.max_seq_len:
            raise StepError(f"[{label}] prompt of {len(ids)} tokens + max_new_tokens {config.max_new_tokens} exceed "
                            f"max_seq_len {config.max_seq_len}")
        watch = _TextWatch(lm.tokenizer, config.stop_strings, block.stream, bar)
        if block.stream:
            stream(prompt)
        stats = engine.generate(ids, config, eos, watch)
        record = _record(prompt, stats.tokens, lm.tokenizer, config, _LlamaCppRow(stats), 0, len(ids))
        if block.stream:
            show(record["output"][watch.shown:])
        records.append(record)
        batches.append({"prefill_s": stats.prefill_s, "decode_s": stats.decode_s})
    if bar is not None:
        bar.close()
        for r in records:
            show(f"\n[{label}] {r['prompt']!r} →\n{r['output']}")
    return {"prompts": records, "metrics": _totals(records, batches), "llama_cpp": engine.describe()}


class _TextWatch:
    """A generation's text as its tokens come (ours streamed, or llama.cpp's): streamed, holding back what could
    still be a stop string, or counted on the bar; true once a stop string has appeared."""

    def __init__(self, tokenizer, stop_strings: list[str], streaming: bool, bar: Progress | None):
        self.tokenizer, self.stop_strings, self.streaming, self.bar = tokenizer, stop_strings, streaming, bar
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.tokens: list[int] = []
        self.shown = 0

    def __call__(self, token: int) -> bool:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self.streaming:
            ready = len(text) - self.holdback - (1 if text.endswith("\ufffd") else 0)
            if ready > self.shown:
                stream(text[self.shown:ready])
                self.shown = ready
        elif self.bar is not None:
            self.bar.update(1)
        return any(stop in text for stop in self.stop_strings)


class _LlamaCppRow:
    """A llama.cpp generation's stats as _record reads a Generator's (one row)."""

    def __init__(self, stats):
        self.stop_reasons = [stats.stop_reason]
        self.prefill_s, self.decode_s = stats.prefill_s, stats.decode_s
        self.decode_tokens_per_s = stats.decode_tokens_per_s


def _write_outputs_csv(path: Path, side_by_side: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(side_by_side[0]["outputs"]) if side_by_side else []
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", *names])
        for row in side_by_side:
            writer.writerow([row["prompt"], *(row["outputs"][n] for n in names)])


def _generate_batch(generator: Generator, tokenizer, prompts: list[str], config: GenerateConfig,
                    bar: Progress) -> list[dict]:
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    steps, stats = [], generator.stats
    for token in generator.steps(enc.input_ids, enc.attention_mask):
        steps.append(token)
        stats = generator.stats
        bar.update(sum(1 for n in stats.new_tokens if n == len(steps)))  # rows still generating
    bar.set_total(bar.total - sum(config.max_new_tokens - n for n in stats.new_tokens))  # rows that stopped early
    new = torch.stack(steps, dim=1)
    return [_record(prompt, new[row, : stats.new_tokens[row]].tolist(), tokenizer, config, stats, row,
                    int(enc.attention_mask[row].sum()))
            for row, prompt in enumerate(prompts)]


def _beam_batch(generator: Generator, tokenizer, prompts: list[str], config: GenerateConfig,
                bar: Progress) -> list[dict]:
    """Beam search: each prompt's best hypothesis as its output; with num_return_sequences > 1 the others too."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = generator.generate(enc.input_ids, enc.attention_mask)  # [B·R, T+N], best first per prompt
    stats, r, start = generator.stats, config.num_return_sequences, enc.input_ids.shape[1]
    bar.update(len(prompts) * config.max_new_tokens)
    hypotheses = [_record(prompt, out[i * r + j, start:start + stats.new_tokens[i * r + j]].tolist(), tokenizer,
                          config, stats, i * r + j, int(enc.attention_mask[i].sum()))
                  | {"beam_score": stats.scores[i * r + j]}
                  for i, prompt in enumerate(prompts) for j in range(r)]
    records = []
    for i in range(len(prompts)):
        best, *others = hypotheses[i * r:(i + 1) * r]
        if others:
            best["alternatives"] = [{k: h[k] for k in ("output", "token_ids", "beam_score", "stop_reason")}
                                    for h in others]
        records.append(best)
    return records


def _stream_one(generator: Generator, tokenizer, prompt: str, config: GenerateConfig) -> list[dict]:
    """Print text as it is decided, holding back what could still turn out to be a stop string."""
    enc = tokenizer([prompt], return_tensors="pt")
    watch = _TextWatch(tokenizer, config.stop_strings, streaming=True, bar=None)
    stream(prompt)
    for token in generator.generate_iter(enc.input_ids, enc.attention_mask):
        watch(token)  # our generator stops at stop strings itself
    record = _record(prompt, watch.tokens, tokenizer, config, generator.stats, 0, enc.input_ids.shape[1])
    show(record["output"][watch.shown:])
    log.info("%d tokens, prefill %.0f ms, %.1f tok/s, stop: %s", record["new_tokens"], record["prefill_s"] * 1000,
             record["decode_tokens_per_s"], record["stop_reason"])
    return [record]


def _record(prompt, tokens: list[int], tokenizer, config: GenerateConfig, stats, row: int, prompt_tokens: int):
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for stop in config.stop_strings:
        text = text.split(stop, 1)[0]
    return {
        "prompt": prompt,
        "output": text,
        "prompt_tokens": prompt_tokens,
        "new_tokens": len(tokens),
        "token_ids": tokens,
        "stop_reason": stats.stop_reasons[row],
        "prefill_s": stats.prefill_s,  # shared by the rows of a batch
        "decode_s": stats.decode_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
    }


def _totals(records: list[dict], batches: list[dict]) -> dict:
    prefill_s = sum(b["prefill_s"] for b in batches)
    decode_s = sum(b["decode_s"] for b in batches)
    new_tokens = sum(r["new_tokens"] for r in records)
    return {
        "prompts": len(records),
        "new_tokens": new_tokens,
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "tokens_per_s": new_tokens / (prefill_s + decode_s) if prefill_s + decode_s > 0 else 0.0,
        "mean_ttft_s": prefill_s / len(batches),
    }
