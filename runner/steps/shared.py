"""What more than one mode needs, so that no step imports another: the prompts of a generate or speculative block,
the draft of a speculative block or a bench matrix's speculative axis, and a cache selection chosen, shown and left in
the step folder (mode auto-cache-select, and `cache_kind: auto` in generate).

The choosing itself is runner.infer.select.autocache; drafting is runner.infer.speculative.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TypeVar

import pandas as pd
from pydantic import BaseModel, ValidationError

from runner.errors import StepError
from runner.files import atomic_write_json
from runner.infer.config.decoding import GenerateConfig
from runner.infer.llamacpp.gguf_file import model_gguf
from runner.infer.loading.models import LoadedModel, load_model_block
from runner.infer.loading.texts import load_text
from runner.infer.select.autocache import Selection, select_cache_kind
from runner.infer.select.joint import select_weights_and_cache
from runner.infer.select.llamacpp import select_llamacpp_kind
from runner.infer.speculative.generator import PROMPT_LOOKUP
from runner.infer.speculative.text import same_tokenizer
from runner.manifest.blocks import DraftSource, GenerateBlock, PromptSource
from runner.manifest.paths import model_source, read_text, text_source
from runner.manifest.plan import Step
from runner.manifest.serve_block import ServeBlock
from runner.report import ProgressFactory, show

log = logging.getLogger(__name__)
Block = TypeVar("Block", bound=BaseModel)

DEFAULT_PROMPTS = ("Once upon a time",)  # when a generate block names no prompts (the seed guide's example)
COLUMNS = {  # row key → table heading
    "kind": "kind", "estimated_mib": "est MiB", "measured_mib": "meas MiB", "delta_nll": "ΔNLL",
    "ppl_ratio": "PPL ratio", "mean_kl": "mean KL", "needle_found": "needle", "tokens_per_s": "tok/s",
    "tokens_per_s_spread": "± tok/s", "timed_on": "timed on", "compile_s": "compile s",
    "task_score": "task score", "task_drop": "task drop", "verdict": "verdict",
}
JOINT_COLUMNS = {"weights": "weights", "weight_mib": "weights MiB", "total_mib": "total MiB"}  # weight_candidates


# -- prompts and the draft --------------------------------------------------------------------------------------------


def reload_model(step: Step, base_dir: Path, dtype: str, quantization: str) -> LoadedModel:
    """The step's model loaded again with other weights: an axis of bench (dtypes, quantizations) or serve."""
    weights = f" with {quantization} weights" if quantization != "none" else ""
    log.info("[%s] loading %s as %s%s", step.key, step.model.get("id") or "config model", dtype, weights)
    return load_model_block(model_source(step.model, base_dir), step.model_seed, base_dir, dtype=dtype,
                            quantization=quantization)


def step_block(cls: type[Block], step: Step) -> Block:
    """The step's block, validated again where it runs (a resumed plan may come from an older runner): settings
    that no longer validate fail this step alone, with the reason, instead of crashing the run."""
    try:
        return cls.model_validate(step.block)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or step.mode}: {e['msg']}" for e in exc.errors())
        raise StepError(f"step {step.key}: its {step.mode} settings do not validate: {problems}") from None

def load_prompts(block: PromptSource, base_dir: Path) -> list[str]:
    if block.prompts is not None:
        return list(block.prompts)
    if block.prompts_file is None:
        log.info("no prompts given: using %s", DEFAULT_PROMPTS)
        return list(DEFAULT_PROMPTS)
    path, text = read_text(block.prompts_file, base_dir, "prompts")
    lines = text.splitlines()
    if path.suffix == ".txt":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise StepError(f'{path}:{n}: expected a JSON object with a "prompt" key') from None
    if not prompts:
        raise StepError(f"prompts_file {path} holds no prompts")
    return prompts


def load_draft(block: DraftSource | ServeBlock, lm: LoadedModel, step: Step, base_dir: Path):
    """(the draft model or the string prompt-lookup, the draft's tokenizer when it is not the target's, else None).
    A draft with another tokenizer proposes through text (runner.infer.speculative.text)."""
    d = block.draft
    assert d is not None  # a serve block's draft is checked present with speculative: draft
    if isinstance(d, str):  # PROMPT_LOOKUP, the one string a draft may be
        return PROMPT_LOOKUP, None
    log.info("loading draft %s (%s)", d.id or "config model", d.dtype)
    draft = load_model_block(model_source(d.model_dump(), base_dir), step.model_seed, base_dir, device=str(lm.device))
    if same_tokenizer(draft.tokenizer, lm.tokenizer):
        return draft.model, None
    log.info("the draft %s has another tokenizer (%d vs %d tokens): its proposals reach the target as text",
             d.id or "config model", len(draft.tokenizer), len(lm.tokenizer))
    return draft.model, draft.tokenizer


# -- a cache selection -----------------------------------------------------------------------------------------------

def select_for(step: Step, block: GenerateBlock, config: GenerateConfig, lm: LoadedModel, base_dir: Path,
               out_dir: Path, progress: ProgressFactory) -> Selection:
    """Select (or reuse a plan), show the table, and leave it in the step folder as CSV, PNG and JSON."""
    joint = bool(config.weight_candidates)
    log.info("[%s] choosing %s among %s (budget %s, max_seq_len %d, batch %d)", step.key,
             "weights × cache kind" if joint else "a cache kind",
             " × ".join(", ".join(c)
                        for c in ([config.weight_candidates] if config.weight_candidates else [])
                        + [config.cache_candidates]),
             _mib(config.memory_budget_mb if joint else config.cache_budget_mb), config.max_seq_len, block.batch_size)
    text = load_text(text_source(config.cache_quality_data, base_dir))
    if config.engine == "llama.cpp":
        selection = select_llamacpp_kind(step_gguf(step, lm, base_dir), lm.tokenizer, config, text=text,
                                         progress=progress)
    else:
        select = select_weights_and_cache if joint else select_cache_kind
        selection = select(lm.model, lm.tokenizer, config, batch_size=block.batch_size, identity=lm.fingerprint,
                           progress=progress, text=text)
    table = candidates_table(selection.rows, joint)
    how = selection.source + (", reused" if selection.reused else "")
    chosen = f"weights {selection.weights}, cache {selection.kind}" if joint else selection.kind
    show(f"[{step.key}] {'weights × cache' if joint else 'cache'} candidates:\n"
         f"{table.to_string(index=False, na_rep='-')}\n"
         f"[{step.key}] → {chosen} ({how}): {selection.reason} [{selection.seconds:.1f} s]")
    if selection.persist_error:
        log.warning("[%s] the measurements are kept in %s, but the cache plan was not saved: %s", step.key, out_dir,
                    selection.persist_error)
    out_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_dir / "cache_candidates.csv", index=False)
    atomic_write_json(out_dir / "cache_plan.json", describe_selection(selection))
    plot_candidates(selection, config, out_dir / "cache_candidates.png")
    return selection


def step_gguf(step: Step, lm: LoadedModel, base_dir: Path) -> Path:
    """The GGUF engine llama.cpp runs for the step's model: the zoo's or a local .gguf as it is, else the loaded
    weights written as an f32 GGUF (runner.infer.llamacpp.gguf_file)."""
    return model_gguf(model_source(step.model, base_dir).get("id"), lm.model, lm.tokenizer, base_dir)


def candidates_table(rows: list[dict], joint: bool = False) -> pd.DataFrame:
    columns = {**JOINT_COLUMNS, **COLUMNS} if joint else COLUMNS
    frame = pd.DataFrame(rows)
    shown = [c for c in columns if c in frame or not c.startswith("task_")]  # task columns with the task gate only
    frame = frame.reindex(columns=shown).rename(columns=columns)
    return frame.round({"est MiB": 2, "meas MiB": 2, "ΔNLL": 5, "PPL ratio": 4, "mean KL": 5, "tok/s": 1,
                        "± tok/s": 1, "compile s": 1, "weights MiB": 2, "total MiB": 2, "task score": 1,
                        "task drop": 1})


def describe_selection(selection: Selection) -> dict:
    weights = {} if selection.weights is None else {"weights": selection.weights}
    return {**weights, "kind": selection.kind, "source": selection.source, "reused": selection.reused,
            "reason": selection.reason, "key": selection.key,
            "plan_path": selection.cache_plan_path, "plan_saved": not selection.persist_error,
            "plan_error": selection.persist_error or None, "seconds": selection.seconds, "candidates": selection.rows,
            "fields": selection.fields}


def selection_params(selection: Selection) -> dict:
    weights = {} if selection.weights is None else {"weights.chosen": selection.weights}
    return {"cache_kind.chosen": selection.kind, "cache_kind.source": selection.source, **weights}


def plot_candidates(selection: Selection, config: GenerateConfig, path: Path) -> None:
    """Per candidate: memory against the budget, ΔNLL against its gate, decode speed; then quality vs memory."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    rows, joint = selection.rows, selection.weights is not None
    kinds = [f"{r['weights']}+{r['kind']}" if joint else r["kind"] for r in rows]
    chosen = [r["kind"] == selection.kind and r.get("weights") == selection.weights for r in rows]
    colours = ["tab:green" if c else "tab:blue" if r["passed"] else "tab:gray" for r, c in zip(rows, chosen)]
    size = (("total_mib", "weights + cache MiB at max_seq_len × batch", config.memory_budget_mb) if joint
            else ("estimated_mib", "cache MiB at max_seq_len × batch", config.cache_budget_mb))
    panels = [size,
              ("delta_nll", "ΔNLL (nats/token)", config.cache_quality_max_delta_nll),
              ("tokens_per_s", "decode tokens/s", None)]
    fig = Figure(figsize=(16, 3.6))
    axes = fig.subplots(1, 4)
    for ax, (name, label, limit) in zip(axes, panels):
        ax.bar(kinds, [r.get(name) or 0.0 for r in rows], color=colours)
        if limit is not None:
            ax.axhline(limit, color="tab:red", linestyle="--", linewidth=1)
        ax.set_title(label, fontsize=10)
    if joint:
        for ax in axes[:3]:
            ax.tick_params(axis="x", labelrotation=90, labelsize=6)
    measured = [(r.get(size[0]), r.get("delta_nll"), k, c) for r, k, c in zip(rows, kinds, colours)]
    measured = [m for m in measured if m[0] is not None and m[1] is not None]
    ax = axes[3]
    ax.scatter([m[0] for m in measured], [m[1] for m in measured], c=[m[3] for m in measured])
    for mib, nll, kind, _ in measured:
        ax.annotate(kind, (mib, nll), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("weights + cache MiB" if joint else "cache MiB")
    ax.set_ylabel("ΔNLL")
    ax.set_title("quality vs memory", fontsize=10)
    what = f"weights {selection.weights}, cache {selection.kind}" if joint else selection.kind
    fig.suptitle(f"cache selection: {what} ({selection.source}); green = chosen, grey = dropped",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _mib(value: float | None) -> str:
    return "none" if value is None else f"{value:g} MiB"


def markdown(frame: pd.DataFrame) -> str:
    """A GitHub markdown table (no tabulate dependency): floats to 3 significant digits (whole numbers from 100
    up), NaN as '-'."""
    def cell(value) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
        return "-" if value is None else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def is_number(value) -> bool:
    """A figure worth logging: a real number, not a boolean, not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
