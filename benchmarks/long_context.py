"""Chunked prefill and the sliding window on a real model at a long context, in one process.

    python benchmarks/long_context.py [--model zoo:smollm2-135m] [--context 4096] [--chunks 128 512]

Prints:
  prefill   whole vs chunked prefill of --context tokens of real text (pydoc): median seconds and peak memory
            added by the prefill (CPU: peak RSS, reset through /proc/self/clear_refs; CUDA: peak allocated),
            each as a ratio to the whole prefill; variants interleaved, order reversed every other repeat,
            after a warm-up of each on the first 256 tokens.
            Also the largest |Δ logit| of the chunked prefill against the whole one.
  window    ΔNLL of the sliding window against the full cache: prefill --context − --decode-steps tokens
            (chunked), then --decode-steps teacher-forced one-token steps through each cache; mean NLL of the
            true next tokens (nats), window minus full, for each --windows size with --sinks and with 0 sinks.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.cache.registry import make_cache  # noqa: E402
from runner.infer.cache.window import DecodePlan  # noqa: E402
from runner.infer.config.kinds import DTYPES  # noqa: E402
from runner.infer.decode.forward import positions_for, prefill  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.loading.texts import load_text, token_windows  # noqa: E402
from runner.infer.measure.quality import planned_nll  # noqa: E402
from runner.infer.measure.timing import on_device, time_interleaved  # noqa: E402

CLEAR_REFS = Path("/proc/self/clear_refs")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measured_prefill(model, ids: torch.Tensor, q_chunk: int | None, peaks: list, logits: dict):
    """A `run_once(tick)` for the harness: one prefill into a fresh cache, timed between its two ticks (the memory
    baseline is taken before the first); appends the peak bytes it added to `peaks`, keeps its last logits."""
    device = ids.device

    def run_once(tick) -> None:
        mask = torch.ones_like(ids)
        cache = make_cache(None, model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed memory back, so the peak starts from the live set
            CLEAR_REFS.write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
            base = _rss_kib("VmRSS") * 1024
        tick()
        with torch.inference_mode():
            logits[q_chunk], _, _ = prefill(model, ids, None, mask, positions_for(None, mask), cache, q_chunk)
        tick()
        used = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_kib("VmHWM") * 1024
        peaks.append(used - base)

    return run_once


def prefill_table(model, ids: torch.Tensor, chunks: list[int], repeats: int) -> None:
    variants = [None, *chunks]
    peaks: dict = {v: [] for v in variants}
    logits: dict = {}
    for v in variants:  # warm-up on a short prefix: first-call costs, not the long prefill again
        measured_prefill(model, ids[:, :256], v, [], {})(lambda: None)
    marks = time_interleaved({v: measured_prefill(model, ids, v, peaks[v], logits) for v in variants}, repeats,
                             warmup=0, **on_device(ids.device))
    times = {v: [m[-1] - m[0] for m in marks[v]] for v in variants}
    t0, p0 = statistics.median(times[None]), statistics.median(peaks[None])
    print(f"\nprefill of {ids.shape[1]} tokens, medians of {repeats} interleaved repeats")
    print(f"{'variant':>14} {'seconds':>8} {'time ratio':>10} {'peak MiB':>9} {'peak ratio':>10} {'max|Δlogit|':>12}")
    for v in variants:
        t, p = statistics.median(times[v]), statistics.median(peaks[v])
        diff = float((logits[v] - logits[None]).abs().max())
        name = "whole" if v is None else f"chunk {v}"
        print(f"{name:>14} {t:8.2f} {t / t0:10.3f} {p / 2**20:9.1f} {p / p0:10.3f} {diff:12.2e}")


def window_table(model, ids: torch.Tensor, decode_steps: int, windows: list[int], sinks: int, q_chunk: int) -> None:
    prompt_len = ids.shape[1] - decode_steps
    seq = ids.shape[1]
    full = planned_nll(model, ids, prompt_len, DecodePlan("fixed", "fixed", seq, q_chunk, None, sinks))
    print(f"\nsliding window: prefill {prompt_len} tokens (chunks of {q_chunk}), then {decode_steps} teacher-forced "
          f"steps; full-cache NLL {full:.4f} nats")
    print(f"{'window':>8} {'sinks':>6} {'NLL':>8} {'ΔNLL':>8} {'PPL ratio':>10}")
    for window in windows:
        for s in sorted({sinks, 0}, reverse=True):
            nll = planned_nll(model, ids, prompt_len, DecodePlan("fixed", "fixed", seq, q_chunk, window, s))
            print(f"{window:>8} {s:>6} {nll:8.4f} {nll - full:+8.4f} {torch.tensor(nll - full).exp():10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--windows", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window-chunk", type=int, default=None, help="prefill chunk before the window's "
                        "decode steps (default: the first of --chunks)")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-window", action="store_true")
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    ids = torch.tensor(token_windows(lm.tokenizer, load_text("pydoc"), args.context, 1), device=lm.device)
    print(f"{args.model} {args.dtype} on {lm.device}, torch threads {torch.get_num_threads()}, "
          f"max_position_embeddings {getattr(lm.model.config, 'max_position_embeddings', '?')}")
    if not args.skip_prefill:
        prefill_table(lm.model, ids, args.chunks, args.repeats)
    if not args.skip_window:
        window_table(lm.model, ids, args.decode_steps, args.windows, args.sinks, args.window_chunk or args.chunks[0])


if __name__ == "__main__":
    main()
