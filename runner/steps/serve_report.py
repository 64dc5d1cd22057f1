"""What a serve step leaves in its folder besides results.json: the points (serve_points.csv), every request
(serve_requests.csv and .parquet), the scheduler's timeline (serve_timeline.csv), and the plots people look at:
latency percentiles, throughput and goodput against rate, the TTFT and TPOT distributions, KV blocks and running
requests over time."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from runner.steps.shared import markdown

SERIES = ["system", "cache_kind", "quantization"]  # what one line of a plot (one series of points) shares
ENDPOINT = "endpoint"  # an endpoint's cache-kind and weights columns: whatever its server was started with
PLAIN_WEIGHTS = ("none", ENDPOINT)  # weights that add nothing to a series' name
POINT_COLUMNS = [*SERIES, "x", "status", "completed", "refused", "errors", "output_tokens_per_s",
                 "requests_per_s", "goodput_per_s", "meets_slo", "p50_ttft_ms", "p90_ttft_ms",
                 "p99_ttft_ms", "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "p90_e2e_ms", "mean_running",
                 "peak_running", "peak_blocks_used", "preemptions", "cached_prompt_tokens", "acceptance", "weight_mib"]


def write_tables(out_dir: Path, points: list[dict], requests: list[dict], timelines: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(points).to_csv(out_dir / "serve_points.csv", index=False)
    frame = pd.DataFrame(requests)
    frame.to_csv(out_dir / "serve_requests.csv", index=False)
    if len(frame):
        frame.to_parquet(out_dir / "serve_requests.parquet", index=False)
    pd.DataFrame(timelines).to_csv(out_dir / "serve_timeline.csv", index=False)


def markdown_points(table: pd.DataFrame) -> str:
    """The points as a GitHub markdown table: the columns people read first (weights only where some are
    quantized)."""
    plain = "quantization" in table and set(table["quantization"]) <= set(PLAIN_WEIGHTS)
    return markdown(table[[c for c in POINT_COLUMNS if c in table.columns and not (plain and c == "quantization")]])


def plot_all(out_dir: Path, points: pd.DataFrame, requests: pd.DataFrame, timeline: pd.DataFrame) -> None:
    ok = points[points["status"] == "ok"] if "status" in points else points
    if ok.empty:
        return
    _against_x(ok, out_dir / "latency_vs_rate.png", [f"p{q}_{m}_ms" for m in ("ttft", "tpot") for q in (50, 90, 99)],
               "latency (ms)")
    _against_x(ok, out_dir / "throughput_vs_rate.png", ["output_tokens_per_s"], "output tokens/s")
    if "goodput_per_s" in ok:
        _against_x(ok, out_dir / "goodput_vs_rate.png", ["goodput_per_s"], "goodput (requests/s meeting the SLO)")
    if len(requests):
        _distributions(requests, out_dir / "latency_distributions.png")
    if len(timeline):
        _timeline(timeline, out_dir / "kv_blocks_over_time.png")


def _against_x(points: pd.DataFrame, path: Path, figures: list[str], ylabel: str) -> None:
    """One panel per figure, one line per series (system, cache kind, weights), against rate (or concurrency)."""
    from matplotlib.figure import Figure

    figures = [f for f in figures if f in points and points[f].notna().any()]
    if not figures:
        return
    columns = min(3, len(figures))
    rows = math.ceil(len(figures) / columns)
    fig = Figure(figsize=(4.5 * columns, 3.4 * rows))
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, figure in zip(axes, figures):
        for series, line in points.groupby(SERIES):
            line = line.sort_values("x")
            ax.plot(line["x"], line[figure], marker="o", linestyle="-" if series[0].startswith("ours") else "--",
                    label=series_label(series))
        ax.set_title(figure, fontsize=9)
        ax.set_xlabel("rate (requests/s)" if points["arrival"].iloc[0] != "concurrency" else "concurrency")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    for ax in axes[len(figures):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _distributions(requests: pd.DataFrame, path: Path) -> None:
    """TTFT and TPOT histograms at the highest rate, one per series (system, cache kind, weights)."""
    from matplotlib.figure import Figure

    done = requests[requests["finish"].isin(["eos", "length", "stop"])].copy()
    if done.empty:
        return
    done = done[done["x"] == done["x"].max()]
    done["ttft_ms"] = (done["first_token_s"] - done["arrival_s"]) * 1000
    n = done["output_tokens"]
    done["tpot_ms"] = ((done["last_token_s"] - done["first_token_s"]) / (n - 1).where(n > 1)) * 1000
    fig = Figure(figsize=(9, 3.4))
    axes = fig.subplots(1, 2)
    for ax, figure in zip(axes, ("ttft_ms", "tpot_ms")):
        for series, rows in done.groupby(SERIES):
            values = rows[figure].dropna()
            if len(values):
                ax.hist(values, bins=30, histtype="step", label=series_label(series))
        ax.set_xlabel(figure.replace("_ms", " (ms)"))
        ax.set_ylabel("requests")
        ax.legend(fontsize=7)
    fig.suptitle(f"at x = {done['x'].max():g}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _timeline(timeline: pd.DataFrame, path: Path) -> None:
    """KV blocks used and running requests over the load, ours, at the highest rate, one line per series."""
    from matplotlib.figure import Figure

    top = timeline[timeline["x"] == timeline["x"].max()]
    fig = Figure(figsize=(9, 3.4))
    axes = fig.subplots(1, 2)
    for series, rows in top.groupby(SERIES):
        axes[0].plot(rows["t_s"], rows["blocks_used"], label=series_label(series))
        axes[1].plot(rows["t_s"], rows["running"], label=series_label(series))
    for ax, label in zip(axes, ("KV blocks used", "running requests")):
        ax.set_xlabel("time since the load started (s)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"continuous batching at x = {top['x'].max():g}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def series_parts(series: tuple) -> list[str]:
    """What a series' names are made of: its system and cache kind, and its weights unless plain."""
    system, kind, quantization = series
    return [system, kind] + ([quantization] if quantization not in PLAIN_WEIGHTS else [])


def series_label(series: tuple) -> str:
    """A series' legend."""
    return " ".join(series_parts(series))
