"""`mode: bench`: time a matrix of cells (engine × batch × prompt length × new tokens × cache kind × dtype ×
speculative) with our decode chain and, beside each, the baselines: transformers' own generate() on the same model,
inputs and cache (hf_*, ratio_*) and transformers' static cache + compiled forward (hfc_*, ratio_hfc_*).

Owns the matrix, real prompts cut from the eval text, failure per cell (recorded with its reason; the others
go on), the table (CSV, parquet when pyarrow is present, markdown shown at the end), the plots and the
metrics. Timing itself is runner.infer.bench.cells and runner.infer.measure.timing.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from runner.errors import RunnerError
from runner.infer.bench.cells import (
    ASSISTED_NA,
    Cell,
    Speculation,
    measure_hf,
    measure_hf_assisted,
    measure_hf_compiled,
    measure_llamacpp,
    measure_ours,
    measure_speculative,
)
from runner.infer.config.kinds import DTYPES
from runner.infer.llamacpp.engine import LlamaCppEngine
from runner.infer.llamacpp.gguf_file import gguf_weight_bytes
from runner.infer.loading.models import LoadedModel
from runner.infer.loading.texts import load_text, token_windows
from runner.infer.measure.timing import copy_bandwidth
from runner.infer.quant.weights import weight_bytes
from runner.manifest.blocks import BenchBlock
from runner.manifest.paths import text_source
from runner.manifest.plan import Step
from runner.report import ProgressFactory, show
from runner.steps.shared import is_number, load_draft, markdown, reload_model, step_block, step_gguf

AXES = ("dtype", "cache_kind", "speculative", "batch", "prompt_len", "new_tokens", "engine", "quantization")
RATIOS = ("tokens_per_s", "decode_tokens_per_s", "ttft_ms")
HEADLINE = ("tokens_per_s", "decode_tokens_per_s", "ttft_ms", "itl_ms", "peak_mib", "kv_mib", "bw_fraction",
            "acceptance", "compile_s", "total_mib")


MIB = 2**20
log = logging.getLogger(__name__)


def run_bench(step: Step, lm: LoadedModel, base_dir: Path, out_dir: Path, progress: ProgressFactory) -> dict:
    block = step_block(BenchBlock, step)
    cells = matrix(block, step.model["dtype"], step.model.get("quantization", "none"))
    text = load_text(text_source(block.data, base_dir))
    bandwidth = copy_bandwidth(lm.device) if block.roofline else None
    if bandwidth:
        log.info("[%s] memory bandwidth (copy): %.1f GB/s", step.key, bandwidth / 1e9)
    draft, draft_tokenizer = load_draft(block.speculative, lm, step, base_dir) if block.speculative else (None, None)
    tokenizers = {"tokenizer": lm.tokenizer, "draft_tokenizer": draft_tokenizer} if draft_tokenizer else {}
    gguf_mib = 0.0
    if "llama.cpp" in block.engines:
        tokenizers["gguf"] = step_gguf(step, lm, base_dir)
        gguf_mib = gguf_weight_bytes(tokenizers["gguf"]) / MIB
    rows, bar = [], progress(step.key, len(cells), "cell")
    loaded = (step.model["dtype"], step.model.get("quantization", "none"))
    for (dtype, quantization), group in itertools.groupby(cells, key=lambda c: (c["dtype"], c["quantization"])):
        try:
            model = (lm.model if (dtype, quantization) == loaded
                     else reload_model(step, base_dir, dtype, quantization).model)
        except RunnerError as exc:  # e.g. int4 weights in float32: these cells fail, the others go on
            for cell in group:
                rows.append(_failed({**cell, "status": "ok", "error": ""}, exc))
                bar.update(note=_label(cell) + " failed")
            continue
        weight_mib = weight_bytes(model) / MIB
        for cell in group:
            row = run_cell(cell, model, lm.tokenizer, text, block, draft, bandwidth, tokenizers)
            row["weight_mib"] = gguf_mib if cell["engine"] == "llama.cpp" else weight_mib  # llama.cpp: its GGUF's
            if "ours_kv_mib" in row:
                row["ours_total_mib"] = weight_mib + row["ours_kv_mib"]
            rows.append(row)
            write_table(pd.DataFrame(rows), out_dir)  # after every cell: an interrupted matrix keeps what it measured
            speed = f" {rows[-1]['ours_tokens_per_s']:.1f} tok/s" if "ours_tokens_per_s" in rows[-1] else ""
            bar.update(note=_label(cell) + speed)
        del model
    bar.close()
    table = with_engine_ratios(with_spec_speedup(pd.DataFrame(rows)))
    write_table(table, out_dir)
    plot_throughput(table, out_dir / "throughput_vs_batch.png")
    plot_latency(table, out_dir / "latency_vs_prompt_len.png")
    show(f"\n[{step.key}] bench results (ours; hf = transformers generate(); hfc = transformers static cache + "
         f"compile; ratio = ours / baseline):\n"
         f"{markdown(summary_columns(table))}")
    cells_json = table.astype(object).where(table.notna(), None).to_dict("records")  # NaN → null
    return {"cells": cells_json, "bandwidth_gbs": bandwidth / 1e9 if bandwidth else None,
            "metrics": metrics(table, bandwidth), "params": {"bench.cells": len(rows)}}


def matrix(block: BenchBlock, model_dtype: str, model_quantization: str = "none") -> list[dict]:
    """Every cell, grouped by dtype and weight quantization (one reload each); cache kinds default to the dtype's
    own."""
    dtypes: Sequence[str] = block.dtypes or [model_dtype]
    speculative = ["off", "on"] if block.speculative else ["off"]
    return [dict(zip(AXES, values)) for dtype in dtypes for quantization in block.quantizations or [model_quantization]
            for values in itertools.product([dtype], block.cache_kinds or [DTYPES[dtype]], speculative,
                                            block.batch_sizes, block.prompt_lens, block.max_new_tokens, block.engines,
                                            [quantization])]


def run_cell(cell: dict, model, tokenizer, text, block: BenchBlock, draft, bandwidth: float | None,
             tokenizers: dict | None = None) -> dict:
    """One row of the table: the cell's axes, our figures (ours_*), the baselines' (hf_*, hfc_*) and the ratios
    (ratio_* = ours / hf, ratio_hfc_* = ours / hf-compiled). A failure (out of memory, an unsupported combination)
    is the row's `error` (a baseline's: `hf_error`, `hfc_error`); the matrix goes on. `tokenizers`: target's and
    draft's, for a draft with another tokenizer (both sides then map through text)."""
    tokenizers = dict(tokenizers or {})
    gguf = tokenizers.pop("gguf", None)
    row = {**cell, "status": "ok", "error": ""}
    if cell["engine"] == "llama.cpp":
        return _llamacpp_row(row, cell, gguf, tokenizer, text, block)
    try:
        ids = prompt_batch(tokenizer, text, cell["batch"], cell["prompt_len"], model.device)
        shared = Cell(cell["new_tokens"], cell["cache_kind"], block.repeats, block.warmup, cell["engine"], bandwidth)
        speculation = None
        if cell["speculative"] == "on":
            assert block.speculative is not None  # cells run speculative only with a speculative block
            speculation = Speculation(draft, block.speculative.spec_k, block.speculative.spec_k_adaptive,
                                      **tokenizers)
        if speculation is not None:
            row |= _prefixed("ours", measure_speculative(model, ids, shared, speculation))
        else:
            row |= _prefixed("ours", measure_ours(model, ids, shared))
    except (RunnerError, RuntimeError, ValueError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        return _failed(row, exc)
    for baseline, prefix in (("hf", "hf"), ("hf-compiled", "hfc")):
        if baseline not in block.baseline:
            continue
        if baseline == "hf" and cell["speculative"] == "on" and cell["batch"] > 1:
            row["hf_error"] = ASSISTED_NA  # not measured: transformers refuses it (our batched rounds have no peer)
            continue
        try:
            if speculation is not None:
                if baseline != "hf":
                    continue  # transformers' assisted generation has no static-cache path to compare with
                figures = measure_hf_assisted(model, ids, shared, speculation)
            else:
                measure = measure_hf if baseline == "hf" else measure_hf_compiled
                figures = measure(model, ids, shared)
            row |= _prefixed(prefix, figures)
            ratio = "ratio" if prefix == "hf" else "ratio_hfc"
            row |= {f"{ratio}_{name}": row[f"ours_{name}"] / figures[name] for name in RATIOS
                    if name in figures and f"ours_{name}" in row and figures[name]}
        except (RunnerError, RuntimeError, ValueError) as exc:
            row[f"{prefix}_error"] = _reason(exc)
    return row


def _llamacpp_row(row: dict, cell: dict, gguf, tokenizer, text, block: BenchBlock) -> dict:
    """A llama.cpp cell: the model's GGUF (its own weight types) with K/V at the cell's kind; no baselines."""
    try:
        if cell["speculative"] == "on":
            raise ValueError("engine llama.cpp has no speculative decoding here")
        ids = prompt_batch(tokenizer, text, cell["batch"], cell["prompt_len"], "cpu")
        engine = LlamaCppEngine(gguf, kind=cell["cache_kind"], n_ctx=cell["prompt_len"] + cell["new_tokens"] + 1)
        shared = Cell(cell["new_tokens"], cell["cache_kind"], block.repeats, block.warmup, "llama.cpp")
        return row | _prefixed("ours", measure_llamacpp(engine, ids, shared)) | {"gguf": Path(gguf).name}
    except (RunnerError, RuntimeError, ValueError) as exc:
        return _failed(row, exc)


def with_engine_ratios(table: pd.DataFrame) -> pd.DataFrame:
    """With more than one engine: every row's tokens/s over each other engine's in the same cell
    (`ratio_<engine>_tokens_per_s`, engine named without dots: eager, compiled, llamacpp)."""
    if "ours_tokens_per_s" not in table or table["engine"].nunique() < 2:
        return table
    keys = [a for a in AXES if a != "engine" and a in table]
    for other in table["engine"].unique():
        theirs = table[table["engine"] == other].set_index(keys)["ours_tokens_per_s"]
        column = f"ratio_{other.replace('.', '')}_tokens_per_s"
        table[column] = [row["ours_tokens_per_s"] / theirs.get(tuple(row[k] for k in keys), math.nan)
                         if row["engine"] != other else math.nan for _, row in table.iterrows()]
    return table


def with_spec_speedup(table: pd.DataFrame) -> pd.DataFrame:
    """Speculative rows get `spec_speedup`: their tokens/s over the same cell's without speculation."""
    if "ours_tokens_per_s" not in table or not (table["speculative"] == "on").any():
        return table
    keys = [a for a in AXES if a != "speculative" and a in table]
    plain = table[table["speculative"] == "off"].set_index(keys)["ours_tokens_per_s"]
    on = table["speculative"] == "on"
    table.loc[on, "spec_speedup"] = [
        row["ours_tokens_per_s"] / plain.get(tuple(row[k] for k in keys), math.nan) for _, row in table[on].iterrows()]
    return table


def prompt_batch(tokenizer, text, batch: int, prompt_len: int, device) -> torch.Tensor:
    """[batch, prompt_len] ids: different windows of the eval text, so no row is padded."""
    return torch.tensor(token_windows(tokenizer, text, prompt_len, batch), device=device)


def write_table(table: pd.DataFrame, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_dir / "bench.csv", index=False)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return
    table.to_parquet(out_dir / "bench.parquet", index=False)


def summary_columns(table: pd.DataFrame) -> pd.DataFrame:
    """The columns people read first, in the order they read them."""
    wanted = [*AXES, "weight_mib", "ours_total_mib", "ours_tokens_per_s", "hf_tokens_per_s", "ratio_tokens_per_s",
              "hfc_tokens_per_s",
              "ratio_hfc_tokens_per_s", "ours_ttft_ms", "ratio_ttft_ms", "ours_itl_ms", "ours_itl_ms_p90",
              "ours_peak_mib", "ours_kv_mib", "ours_kv_buffer_mib", "ours_bw_fraction", "ours_acceptance",
              "ours_acceptance_row_min",
              "ours_acceptance_row_max", "ours_batched", "ours_compile_s", "hfc_compile_s", "spec_speedup",
              *(c for c in table.columns if c.startswith("ratio_") and c.endswith("_tokens_per_s")
                and c.split("_")[1] in ("eager", "compiled", "llamacpp")), "error",
              "hf_error", "hfc_error"]
    present = [c for c in wanted if c in table.columns]
    frame = table[present].copy()
    for column in ("error", "hf_error", "hfc_error"):
        if column in frame and not frame[column].fillna("").astype(bool).any():
            frame = frame.drop(columns=column)
    return frame


def metrics(table: pd.DataFrame, bandwidth: float | None) -> dict:
    """Per cell `<cell>.<figure>` (with `<figure>_spread` beside, for run compare), and a few headline figures."""
    out = {"cells": float(len(table)), "cells_failed": float((table["status"] != "ok").sum())}
    if bandwidth:
        out["bandwidth_gbs"] = bandwidth / 1e9
    for row in table.to_dict("records"):
        if row["status"] != "ok":
            continue
        name = metric_name(row)
        for figure in HEADLINE:
            for side in ("ours", "hf", "hfc"):
                value = row.get(f"{side}_{figure}")
                if is_number(value):
                    out[f"{name}.{side}_{figure}"] = value
                spread = row.get(f"{side}_{figure}_spread")
                if is_number(spread):
                    out[f"{name}.{side}_{figure}_spread"] = spread
        engines = (f"ratio_{e}_tokens_per_s" for e in ("eager", "compiled", "llamacpp"))
        for ratio in (*(f"{r}_{n}" for r in ("ratio", "ratio_hfc") for n in RATIOS), "spec_speedup", *engines):
            if is_number(row.get(ratio)):
                out[f"{name}.{ratio}"] = row[ratio]
    ratios = table["ratio_tokens_per_s"].dropna() if "ratio_tokens_per_s" in table else pd.Series(dtype=float)
    if len(ratios):
        out["median_ratio_tokens_per_s"] = float(ratios.median())
    return out


def metric_name(row: dict) -> str:
    """MLflow-safe cell name, e.g. b1_p128_n64_q8_0_float32 (kivi options: kivi4-g32-r32)."""
    name = f"b{row['batch']}_p{row['prompt_len']}_n{row['new_tokens']}_{row['cache_kind']}_{row['dtype']}"
    name += {"compiled": "_compiled", "llama.cpp": "_llamacpp"}.get(row.get("engine") or "eager", "")
    name += f"_w{row['quantization']}" if row.get("quantization", "none") != "none" else ""
    name += "_spec" if row["speculative"] == "on" else ""
    return re.sub(r"[^A-Za-z0-9_.\-/ ]", "-", name)


def plot_throughput(table: pd.DataFrame, path: Path) -> None:
    """Tokens/s against batch size, one line per cache kind (hf dashed), one panel per prompt length."""
    _plot(table, path, x="batch", y="tokens_per_s", panel="prompt_len", xlabel="batch size", ylabel="tokens/s",
          title="prompt {} tokens")


def plot_latency(table: pd.DataFrame, path: Path) -> None:
    """Time to first token against prompt length, one line per cache kind (hf dashed), at each batch size."""
    _plot(table, path, x="prompt_len", y="ttft_ms", panel="batch", xlabel="prompt tokens",
          ylabel="time to first token (ms)", title="batch {}")


def _plot(table: pd.DataFrame, path: Path, x: str, y: str, panel: str, xlabel: str, ylabel: str, title: str) -> None:
    from matplotlib.figure import Figure

    ok = table[(table["status"] == "ok") & (table["speculative"] == "off")] if len(table) else table
    if ok.empty or f"ours_{y}" not in ok:
        return
    panels = sorted(ok[panel].unique())
    fig = Figure(figsize=(4.5 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colours: dict[tuple, str] = {}
    for ax, value in zip(axes, panels):
        for (kind, dtype, engine, weights), lines in ok[ok[panel] == value].groupby(
                ["cache_kind", "dtype", "engine", "quantization"]):
            lines = lines.groupby(x)[[c for c in (f"ours_{y}", f"hf_{y}") if c in lines]].median().reset_index()
            colour = colours.setdefault((kind, dtype, engine, weights), f"C{len(colours) % 10}")
            weights = f" w:{weights}" if weights != "none" else ""
            ax.plot(lines[x], lines[f"ours_{y}"], marker="o", color=colour, label=f"{kind} {dtype} {engine}{weights}")
            if f"hf_{y}" in lines:
                ax.plot(lines[x], lines[f"hf_{y}"], marker="x", linestyle="--", color=colour, label=f"{kind} hf")
        ax.set_xticks(sorted(ok[x].unique()))
        ax.set_title(title.format(value), fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle("ours (solid) vs transformers generate() (dashed); medians", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _prefixed(side: str, figures: dict) -> dict:
    return {f"{side}_{name}": value for name, value in figures.items()}


def _failed(row: dict, exc: Exception) -> dict:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.warning("[bench] %s failed: %s", _label(row), _reason(exc))
    return {**row, "status": "failed", "error": _reason(exc)}


def _reason(exc: Exception) -> str:
    kind = "out of memory" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
    return f"{kind}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _label(cell: dict) -> str:
    flags = " spec" if cell["speculative"] == "on" else ""
    flags += f" {cell['engine']}" if cell.get("engine", "eager") != "eager" else ""
    weights = f" w:{cell['quantization']}" if cell.get("quantization", "none") != "none" else ""
    return (f"b{cell['batch']} p{cell['prompt_len']} n{cell['new_tokens']} {cell['cache_kind']} {cell['dtype']}"
            f"{weights}{flags}")

