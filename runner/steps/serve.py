"""mode: serve: one load per point (rate, or the closed loop), served by our continuous-batching scheduler for each
cache kind and engine (system "ours" on the eager engine, "ours-compiled" on the compiled one: CompiledSlots, its
one shape compiled before the point's clock starts; its compile seconds and any recompilations are in the point),
and by the baselines on the same requests: static batching (our Generator fed fixed batches) and
transformers' own continuous batching where it runs. The driver, the load and the metrics are runner.infer.serve's;
this step lays the points side by side, writes the tables and plots, and names the highest rate meeting the SLO.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import pandas as pd

from runner.errors import StepError
from runner.infer.compiled.engine import length_bucket
from runner.infer.config.architecture import compiled_refusal
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.kinds import compiled_serve_reason, speculative_serve_reason
from runner.infer.loading.models import LoadedModel
from runner.infer.loading.texts import load_text
from runner.infer.loading.zoo import fetch_gguf, zoo_entry
from runner.infer.quant.weights import weight_bytes
from runner.infer.serve.compiled_slots import CompiledSlots
from runner.infer.serve.driver import drive, load_clock
from runner.infer.serve.live import SchedulerConfig
from runner.infer.serve.load import Load, LoadSpec, build_load
from runner.infer.serve.metrics import max_rate_meeting, occupancy, point_meets, summarize
from runner.infer.serve.prompts import prompt_lines
from runner.infer.serve.remote import Endpoint, RemoteServer, launched
from runner.infer.serve.requests import RequestRecord
from runner.infer.serve.scheduler import Scheduler
from runner.infer.serve.static import StaticBatcher
from runner.infer.serve.transformers_cb import TransformersServer, transformers_cb_reason
from runner.manifest.paths import read_text, text_source
from runner.manifest.plan import Step
from runner.manifest.serve_block import EndpointBlock, ServeBlock
from runner.report import ProgressFactory, show
from runner.steps.serve_report import (
    ENDPOINT,
    SERIES,
    markdown_points,
    plot_all,
    series_label,
    series_parts,
    write_tables,
)
from runner.steps.shared import is_number, load_draft, reload_model, step_block

log = logging.getLogger(__name__)
MIB = 2**20
DEFAULT_TRANSFORMERS_BLOCKS = 4096  # its paged cache needs a size: with no KV budget given, room for 4096 blocks
HEADLINE = ("output_tokens_per_s", "requests_per_s", "goodput_per_s", "p50_ttft_ms", "p90_ttft_ms",
            "p99_ttft_ms", "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "p90_e2e_ms", "completed", "refused",
            "errors", "preemptions", "cached_prompt_tokens", "acceptance", "mean_running", "peak_running",
            "peak_blocks_used", "compile_s", "recompiles")
OURS = {"eager": "ours", "compiled": "ours-compiled"}  # engine → our system's name
LOOKUP = "ours-lookup"  # the eager engine with prompt-lookup speculation (speculative: prompt-lookup)
DRAFT = "ours-draft"  # the eager engine with a draft model's speculation (speculative: draft)
SPECULATING = (LOOKUP, DRAFT)


def run_serve(step: Step, lm: LoadedModel, base_dir: Path, out_dir: Path, progress: ProgressFactory) -> dict:
    block = step_block(ServeBlock, step)
    text = load_text(text_source(block.data, base_dir)).text
    prompts = _prompts_file(block, base_dir)
    sampling = GenerateConfig(temperature=0.0, seed=step.seed, max_seq_len=_max_seq_len(lm))
    kinds: list[str | None] = list(block.cache_kinds) if block.cache_kinds else [None]  # None: the model dtype
    systems = [(name, kind) for name in (*_ours(block), *block.baselines) for kind in kinds]
    systems += [(endpoint.name, ENDPOINT) for endpoint in block.endpoints]
    specs = block.load_specs()
    own = step.model.get("quantization", "none")
    weights = block.quantizations or [own]  # the model is loaded again for each but its own
    points, requests, timelines = [], [], []
    draft, draft_tokenizer = load_draft(block, lm, step, base_dir) if "draft" in block.speculative else (None, None)
    draft_reason = ("the draft has another tokenizer than the target's: under load a draft must share it (text "
                    "drafts run in mode: speculative)") if draft_tokenizer is not None else ""
    bar = progress(step.key, len(specs) * len(systems) * len(weights) * _count(specs[0]), "request")
    with ExitStack() as servers:  # launched endpoints: up for the whole step, stopped after it (or on a failure)
        for endpoint in block.endpoints:
            if endpoint.launch:
                log.info("[%s] starting endpoint %s: %s", step.key, endpoint.name, " ".join(endpoint.launch))
                servers.enter_context(launched(_command(endpoint.launch, base_dir), _endpoint(endpoint),
                                               out_dir / f"endpoint-{endpoint.name}.log", endpoint.launch_timeout_s))
        for quantization in weights:
            served = lm if quantization == own else reload_model(step, base_dir, step.model["dtype"], quantization)
            weight_mib = weight_bytes(served.model) / MIB
            for spec in specs:
                for system, kind in systems:
                    if kind == ENDPOINT and quantization != weights[0]:  # an endpoint serves its own weights: once
                        bar.update(_count(spec))
                        continue
                    keys = _point_keys(system, kind, spec, ENDPOINT if kind == ENDPOINT else quantization)
                    label = f"{series_label(tuple(keys[k] for k in SERIES))} {_x_label(spec)}"
                    reason = _reason(system, kind, served, block, draft_reason)
                    if reason:
                        points.append({**keys, "status": f"not run: {reason}"})
                        log.info("[%s] %s: not run: %s", step.key, label, reason)
                        bar.update(_count(spec), note=f"{label} not run")
                        continue
                    point, records, timeline = _point(keys, kind, spec, served, block, sampling, draft,
                                                      partial(build_load, spec, served.tokenizer, text, prompts),
                                                      lambda _r: bar.update(1))
                    if kind != ENDPOINT:
                        point["weight_mib"] = weight_mib
                    points.append(point)
                    requests += [_request_row(point, r) for r in records]
                    timelines += [{**keys, "t_s": t, "running": run, "blocks_used": used, "waiting": wait}
                                  for t, run, used, wait in timeline]
                    bar.update(0, note=f"{label}: {point['output_tokens_per_s']:.1f} tok/s")
                    write_tables(out_dir, points, requests, timelines)  # after every point: an interrupt keeps them
            del served  # freed before the next weights load
    bar.close()
    table = pd.DataFrame(points)
    write_tables(out_dir, points, requests, timelines)
    plot_all(out_dir, table, pd.DataFrame(requests), pd.DataFrame(timelines))
    best = _max_rates(table, block)
    show(f"\n[{step.key}] serve results (x = {'concurrency' if block.arrival == 'concurrency' else 'rate req/s'}; "
         f"latencies in ms from each request's scheduled arrival):\n{markdown_points(table)}")
    for series, rate in best.items():
        show(f"[{step.key}] highest rate meeting the SLO, {series_label(series)}: "
             f"{rate if rate is not None else 'none'}")
    return {"points": table.astype(object).where(table.notna(), None).to_dict("records"),
            "max_rate_meeting_slo": {_series_key(*series): r for series, r in best.items()},
            "metrics": _metrics(table, best), "params": {"serve.points": len(points)}}


def _point(keys: dict, kind: str | None, spec: LoadSpec, lm: LoadedModel, block: ServeBlock,
           sampling: GenerateConfig, draft, load: Callable[..., Load], on_finish: Callable[[RequestRecord], None]
           ) -> tuple[dict, list[RequestRecord], list]:
    """One point (`keys`: its system, kind, weights, x): the warm-up load (if any) on a server of its own, then the
    measured load → (its row, its requests' records, the scheduler's timeline)."""
    system = keys["system"]
    warm = load(warmup=True)
    compile_s = 0.0  # the compiled engine's warm-up compile, before any clock starts
    if warm.requests:  # warm-up: its own requests on a server of its own, outside the measured load
        warm_server = _server(system, kind, lm, block, sampling, draft)
        compile_s += getattr(warm_server, "compile_s", 0.0)
        _serve(warm_server, warm)
    server = _server(system, kind, lm, block, sampling, draft)
    compile_s += getattr(server, "compile_s", 0.0)
    records = _serve(server, load(), on_finish)
    timeline = getattr(server, "timeline", [])
    summary = summarize(records, block.percentiles, block.slo.slo() if block.slo else None)
    point = {**keys, "status": "ok", **summary, **occupancy(timeline)}
    if isinstance(server, Scheduler) and server.config.spec_k:
        point |= {"drafted_tokens": server.drafted, "accepted_tokens": server.accepted,
                  "acceptance": server.accepted / server.drafted if server.drafted else float("nan")}
    if isinstance(server, CompiledSlots):  # recompiles: graphs made during the measured load (should be 0)
        point |= {"compile_s": compile_s, "recompiles": server.recompiles, "rebases": server.rebases,
                  "stagings": server.stagings, "shared_forwards": server.shared_forwards, "slot_rows": server.slots,
                  "slot_columns": server.columns}
    if isinstance(server, CompiledSlots) or (isinstance(server, Scheduler) and server.store is not None):
        # the slots' static cache (and their retained prefixes' copies), or the pool's storage
        point["kv_allocated_mib"] = server.kv_bytes() / MIB
    if isinstance(server, RemoteServer):  # prompt tokens as the server's own tokenizer counted them
        server.count_prompt_tokens()
        counted = server.server_prompt_tokens
        point["prompt_tokens_unchecked"] = sum(r.id not in counted for r in records if r.ok)
        point["prompt_tokens_mismatched"] = sum(counted[r.id] != r.prompt_tokens for r in records if r.id in counted)
    if block.slo:
        point["meets_slo"] = point_meets(summary, block.slo.slo())
    return point, records, timeline


def _serve(server, load, on_finish=None) -> list[RequestRecord]:
    """`load` on `server`, on a clock of its own; a server with threads of its own (transformers') is closed."""
    try:
        return drive(server, load, load_clock(), time.sleep, on_finish=on_finish)
    finally:
        if hasattr(server, "close"):
            server.close()


def _server(system: str, kind: str | None, lm: LoadedModel, block: ServeBlock, sampling: GenerateConfig,
            draft=None):
    endpoint = next((e for e in block.endpoints if e.name == system), None)
    if endpoint is not None:
        return RemoteServer(_endpoint(endpoint), lm.tokenizer, max_in_flight=_max_in_flight(block),
                            seed=sampling.seed)
    if system in (*OURS.values(), *SPECULATING):
        config = scheduler_config(block, kind, sampling, speculating=system in SPECULATING)
        if system == OURS["compiled"]:
            return CompiledSlots(lm.model, config, tokenizer=lm.tokenizer,
                                 columns=slot_columns(block, sampling.max_seq_len))
        return Scheduler(lm.model, config, tokenizer=lm.tokenizer, draft=draft if system == DRAFT else None)
    if system == "static":
        return StaticBatcher(lm.model, max_batch_size=block.max_batch_size, max_wait_ms=block.max_wait_ms,
                             sampling=sampling.model_copy(update={"cache_kind": kind}))
    blocks = block.kv_blocks or (None if block.kv_budget_mib is not None else DEFAULT_TRANSFORMERS_BLOCKS)
    return TransformersServer(lm.model, max_batch_size=block.max_batch_size, block_size=block.block_size,
                              num_blocks=blocks, kv_budget_mb=block.kv_budget_mib if blocks is None else None,
                              prefix_caching=block.prefix_caching, seed=sampling.seed or 0)


def _endpoint(block: EndpointBlock) -> Endpoint:
    return Endpoint(block.name, block.url, block.model, block.api, block.prompt_format, block.suppress_eos)


def _max_in_flight(block: ServeBlock) -> int:
    """Threads (and connections) of a remote point: every request of an open load may be in flight at once, up to
    a bound; a closed loop has its users'."""
    return block.concurrency or min(256, max(16, 4 * block.max_batch_size))


def _command(command: list[str], base_dir: Path) -> list[str]:
    """A launch command with its placeholders filled: {python}, {manifest_dir}, {gguf:NAME} (fetched if needed)."""
    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name == "python":
            return sys.executable
        if name == "manifest_dir":
            return str(base_dir)
        return str(fetch_gguf(zoo_entry("zoo:" + name.removeprefix("gguf:"))))
    return [re.sub(r"\{([^{}]*)\}", fill, arg) for arg in command]


def _reason(system: str, kind: str | None, lm: LoadedModel, block: ServeBlock, draft_reason: str) -> str:
    """Why a baseline, our compiled engine or a speculating system cannot serve this point ('' when it can)."""
    if system == "transformers":
        return transformers_cb_reason(lm.model, kind)
    if system == OURS["compiled"]:
        return compiled_refusal(lm.model.config) or compiled_serve_reason(kind)
    if system in SPECULATING:
        return speculative_serve_reason(kind) or (draft_reason if system == DRAFT else "")
    return ""


def _ours(block: ServeBlock) -> list[str]:
    """Our systems: one per engine (eager's only if speculative has none), then ours-lookup and ours-draft if asked."""
    names = [OURS[e] for e in block.engines if e != "eager" or "none" in block.speculative]
    return names + [LOOKUP] * ("prompt-lookup" in block.speculative) + [DRAFT] * ("draft" in block.speculative)


def scheduler_config(block: ServeBlock, kind: str | None, sampling: GenerateConfig,
                     speculating: bool = False) -> SchedulerConfig:
    """Our scheduler's limits as a serve block gives them: for `mode: serve` and for `run serve` alike."""
    return SchedulerConfig(cache_kind=kind, block_size=block.block_size, num_blocks=block.kv_blocks,
                           spec_k=block.spec_k if speculating else 0,
                           kv_budget_bytes=int(block.kv_budget_mib * MIB) if block.kv_budget_mib is not None else None,
                           max_tokens_per_step=block.max_tokens_per_step, max_running=block.max_batch_size,
                           max_queue=block.max_queue, prefix_caching=block.prefix_caching,
                           prefix_cache_blocks=block.prefix_cache_blocks, sampling=sampling)


def slot_columns(block: ServeBlock, max_seq_len: int) -> int:
    """Columns of the compiled slots' cache: the longest request the load may draw (prompt + output, times the
    turns a conversation's prompt accumulates; max_seq_len for a prompts file's whole prompts) as a length bucket,
    capped by max_seq_len; a longer request is an error of its own (`run serve`: a 400)."""
    prompt = block.prompt_lengths()
    need = max_seq_len if prompt is None else block.turns * (prompt.high + block.output_tokens.lengths().high)
    return length_bucket(min(need, max_seq_len), max_seq_len)


def _prompts_file(block: ServeBlock, base_dir: Path) -> list[str] | None:
    if block.prompts_file is None:
        return None
    path, text = read_text(block.prompts_file, base_dir)
    try:
        return [prompt for _, prompt in prompt_lines(text, path.suffix == ".jsonl")]
    except ValueError as exc:
        raise StepError(f"prompts file {path}: {exc}") from None


def _max_seq_len(lm: LoadedModel) -> int | None:
    return getattr(lm.model.config, "max_position_embeddings", None)


def _count(spec: LoadSpec) -> int:
    return (spec.num_requests or spec.concurrency or 1) * spec.turns


def _x(spec: LoadSpec) -> float:
    return float(spec.rate if spec.rate is not None else spec.concurrency or 1)


def _x_label(spec: LoadSpec) -> str:
    return f"rate {spec.rate:g}/s" if spec.rate is not None else f"concurrency {spec.concurrency}"


def _point_keys(system: str, kind: str | None, spec: LoadSpec, quantization: str) -> dict:
    return {"system": system, "cache_kind": kind or "model", "quantization": quantization, "x": _x(spec),
            "arrival": spec.arrival}


def _series_key(*series: str) -> str:
    """A series' name in results.json: system/kind, and /weights when they are not the model's plain ones."""
    return "/".join(series_parts(series))


def _request_row(point: dict, record: RequestRecord) -> dict:
    lat = [b - a for a, b in zip(record.token_s, record.token_s[1:])]
    return {**{k: point[k] for k in SERIES}, "x": point["x"], "id": record.id,
            "arrival_s": record.arrival_s, "scheduled_s": record.scheduled_s,
            "first_token_s": record.token_s[0] if record.token_s else None,
            "last_token_s": record.token_s[-1] if record.token_s else None, "prompt_tokens": record.prompt_tokens,
            "output_tokens": len(record.token_s), "finish": record.finish, "error": record.error,
            "preemptions": record.preemptions, "cached_prompt_tokens": record.cached_prompt_tokens,
            "max_itl_ms": max(lat) * 1000 if lat else None, "output_ids": " ".join(map(str, record.output_ids))}


def _max_rates(table: pd.DataFrame, block: ServeBlock) -> dict[tuple[str, str, str], float | None]:
    """(system, kind, weights) → the highest rate meeting the SLO (open-loop loads with an SLO only)."""
    if block.slo is None or block.arrival == "concurrency" or table.empty:
        return {}
    out = {}
    for series, rows in table[table["status"] == "ok"].groupby(SERIES):
        out[series] = max_rate_meeting({row["x"]: row for row in rows.to_dict("records")}, block.slo.slo())
    return out


def _metrics(table: pd.DataFrame, best: dict) -> dict:
    """`<system>_<kind>[_w<weights>]_x<rate>.<metric>` per point, ours/baseline ratios of output throughput (same
    kind, weights and x), and the highest rate meeting the SLO per series."""
    out: dict[str, float] = {"points": float(len(table))}
    ok = table[table["status"] == "ok"] if "status" in table else table
    ours = [*OURS.values(), *SPECULATING]
    for row in ok.to_dict("records"):
        name = _name(row["system"], row["cache_kind"], row["quantization"], row["x"])
        out |= {f"{name}.{k}": float(row[k]) for k in HEADLINE if is_number(row.get(k))}
        beside = ok[(ok["cache_kind"] == row["cache_kind"]) & (ok["quantization"] == row["quantization"])
                    & (ok["x"] == row["x"])]
        for baseline in ("static", "transformers"):
            other = beside[beside["system"] == baseline]
            if row["system"] in ours and len(other) and other.iloc[0]["output_tokens_per_s"] > 0:
                out[f"{name}.ratio_{baseline}_throughput"] = (row["output_tokens_per_s"]
                                                            / other.iloc[0]["output_tokens_per_s"])
        eager = beside[beside["system"] == OURS["eager"]]
        faster = row["system"] in (OURS["compiled"], *SPECULATING)  # than the eager engine alone?
        if faster and len(eager) and eager.iloc[0]["output_tokens_per_s"] > 0:
            out[f"{name}.ratio_eager_throughput"] = (row["output_tokens_per_s"]
                                                     / eager.iloc[0]["output_tokens_per_s"])
    mine = ok[ok["system"].isin(ours)] if len(ok) else ok
    if len(mine):  # headline figures `run results` shows by default
        out["max_output_tokens_per_s"] = float(mine["output_tokens_per_s"].max())
    ratios = [v for k, v in out.items() if k.endswith(".ratio_static_throughput") and not k.startswith(SPECULATING)]
    if ratios:
        out["median_ratio_static_throughput"] = float(pd.Series(ratios).median())
    for series, rate in best.items():
        if rate is not None:
            out[f"{_name(*series)}.max_rate_meeting_slo"] = float(rate)
    return out


def _name(system: str, kind: str, quantization: str, x: float | None = None) -> str:
    parts = series_parts((system, kind, quantization))
    name = "_".join(parts[:2] + [f"w{w}" for w in parts[2:]]) + (f"_x{x:g}" if x is not None else "")
    return re.sub(r"[^A-Za-z0-9_.\-/ ]", "-", name)

