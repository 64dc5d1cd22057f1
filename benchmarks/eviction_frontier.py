"""KV eviction on RULER-style tasks: runner's presses against kvpress's, and the bytes × score frontier of
quantization, eviction and both (issue 35, items 5, 7 and 8).

    python benchmarks/eviction_frontier.py                  # the default run (~35-45 min on a shared 2-core CPU)
    python benchmarks/eviction_frontier.py --quick          # a smoke run: 1 sample of 256 tokens, 2 presses
    python benchmarks/eviction_frontier.py --model zoo:qwen2.5-coder-1.5b --length 4096 --threads 2 \
        --methods tova snapkv --skip-kvpress --ratios 0.5 0.75 0.875 0.9375 0.96875 --quant q8_0 kivi4 kivi2 \
        --stack q8_0:0.75 q8_0:0.875 q8_0:0.9375 kivi4:0.5 kivi4:0.625 kivi4:0.75 kivi4:0.875 kivi4:0.9375
                                                            # item 8 at 4k, part 1 skipped (~70 min alone)

One process, one model (default zoo:smollm2-135m, fp32 weights), one set of task samples (default niah_single_1,
niah_multikey_1 and vt at 1024 tokens, --count each, seed 0) answered greedily on every configuration below; every
sample's answer is capped at --max-new-tokens (both sides) so that the two implementations decode alike.

1. ours against kvpress, per press both implement, at --ratio (0.5):
   ours `fp16+<method>:<ratio>` through runner.infer.tasks.evaluate.answer with q_chunk=None (one prompt forward: a
   chunked prefill would evict each chunk on its own); kvpress 0.5.5 through benchmarks/kvpress_reference.py on
   the *same token ids*, the whole prompt given as kvpress's context with no question, so both compress the
   whole prompt (question and answer prefix included) and then decode greedily. The choice of kept tokens is made
   from the exact float K/V on both sides (ours stores them in fp16, kvpress in fp32: the fp16 rows double as the
   frontier's eviction-only points at that ratio). kvpress's greedy ids are cut by the same stop rules as ours
   (answered, line break) and scored by the same metric.
   Per press: our score and kvpress's [95 % interval] with n; the paired difference's 95 % interval (Student's t
   over the per-sample differences); how many answers agree; the mean Jaccard overlap of the kept positions per
   layer and KV head; prefill seconds per sample, decode ms per token and the peak RSS added, for each side
   (kvpress's prefill includes recording its kept rows); the fraction of the answer's token positions (the
   needle's value, vt's names, wherever they occur in the prompt) kept, averaged over layers and KV heads.
2. the frontier: bytes (measured after the prefill, summed over the samples, over fp16's on the same samples)
   against the average score over every sample: quantization only (--quant), eviction only (fp16 + the --best
   methods of part 1, or the --methods named, at every --ratios), and both (--stack kinds × those methods).
   The evicting kinds of the frontier share one prompt forward a sample (task_eval.answer_kinds: the same
   answers and bytes as one forward each; their prefill seconds are the shared forward's, every kind's store in it,
   their peak memory is the group's), so each costs little more than its decoding: what makes 4k affordable.
   The frontier of each family is its Pareto set. The target (item 8): a configuration at ≤ 0.15× fp16's bytes
   within 2 points of fp16's average, beating the best quantization alone and the best eviction alone at no more
   bytes.

Writes --out (default runs/eviction_frontier/): compare.csv, frontier.csv, samples.csv (every sample of
every configuration: prediction, score, seconds, bytes), frontier.png; prints both tables as markdown.
Rows are written as they finish, so an interrupted run leaves what it measured, and a rerun with the same model,
tasks, length, count, seed and cap (run.json in --out) takes our answers from samples.csv instead of answering again.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runner, when run as a plain script

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import runner.infer.tasks.evaluate as task_eval  # noqa: E402
from runner.infer.cache.evicting import EvictingMixin  # noqa: E402
from runner.infer.measure.timing import PeakMemory  # noqa: E402
from runner.infer.tasks.ruler import make_samples  # noqa: E402
from runner.infer.tasks.scoring import TaskScore, interval, postprocess, score, t975  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_reference import run_kvpress  # noqa: E402

PRESSES = {"streaming": "streaming_llm", "snapkv": "snapkv", "tova": "tova", "knorm": "knorm",
           "h2o": "observed_attention", "expected": "expected_attention"}  # ours → kvpress's
PREFERENCE = ["snapkv", "expected", "tova", "h2o", "knorm", "streaming"]  # ties in part 1 are broken in this order
TARGET_BYTES, TARGET_POINTS = 0.15, 2.0


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def capped(samples, cap: int):
    return [dataclasses.replace(s, max_new_tokens=min(s.max_new_tokens, cap)) for s in samples]


# ---- ours


def run_ours(model, tokenizer, samples, kinds: list[str], share: bool, done_one=lambda kind, result: None,
             previous: dict | None = None) -> dict[str, dict]:
    """Every sample answered on each of `kinds` (one prompt forward each, or with `share` one for all evicting
    kinds: task_eval.answer_kinds), with the kept columns of each evicting layer; the peak RSS added per sample
    is the group's when shared. `done_one(kind, result)` as each answer is in (samples.csv, row by row).
    `previous[(kind, task, index)]`: answers of an interrupted run, taken as they are (no kept columns, no peak)."""
    previous = previous or {}
    made: dict = {}
    make_cache = task_eval.make_cache

    def recording(kind_, model_):
        made[kind_] = cache = make_cache(kind_, model_)  # the last cache made for a kind is the one it answered on
        return cache

    task_eval.make_cache = recording
    got: dict[str, dict] = {kind: {"results": [], "kept": [], "peaks": []} for kind in kinds}
    try:
        for sample in samples:
            for kind in kinds:
                if (kind, sample.task, sample.index) in previous:
                    got[kind]["results"].append(previous[kind, sample.task, sample.index])
                    got[kind]["kept"].append(None)
            todo = [kind for kind in kinds if (kind, sample.task, sample.index) not in previous]
            for group in ([todo] if share else [[kind] for kind in todo]) if todo else []:
                made.clear()
                ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed memory back: the peak starts from the live set
                base = rss_bytes()
                with PeakMemory(torch.device("cpu")) as peak:
                    results = task_eval.answer_kinds(model, tokenizer, sample, group, q_chunk=None)
                for kind, result in zip(group, results):
                    layers = [layer for layer in made[kind].layers if isinstance(layer, EvictingMixin)]
                    got[kind]["results"].append(result)
                    got[kind]["kept"].append([layer.kept_index[0].tolist() for layer in layers
                                              if layer.kept_index is not None] or None)
                    got[kind]["peaks"].append(peak.bytes - base)
                    done_one(kind, result)
                made.clear()
    finally:
        task_eval.make_cache = make_cache
    return {kind: {"results": g["results"], "kept": g["kept"], "peak": max(g["peaks"], default=0)}
            for kind, g in got.items()}


def resumed(out: Path, setup: dict, samples) -> dict:
    """Our answers in out/samples.csv when out/run.json holds the same `setup`, by (kind, task, index); else none
    (and run.json is written for the next run)."""
    meta, rows = out / "run.json", out / "samples.csv"
    if not (meta.exists() and rows.exists() and json.loads(meta.read_text()) == setup):
        meta.write_text(json.dumps(setup, indent=1))
        rows.unlink(missing_ok=True)
        return {}
    by_key = {(s.task, s.index): s for s in samples}
    previous = {}
    with rows.open(newline="") as f:
        for r in csv.DictReader(f):
            sample = by_key.get((r["task"], int(r["index"])))
            if r["side"] == "ours" and sample is not None:
                previous[r["kind"], sample.task, sample.index] = task_eval.SampleResult(
                    sample=sample, prediction=r["prediction"], score=float(r["score"]),
                    prompt_tokens=int(r["prompt_tokens"]), new_tokens=int(r["new_tokens"]), stop=r["stop"],
                    prefill_s=float(r["prefill_s"]), decode_s=float(r["decode_s"]), cache_bytes=int(r["cache_bytes"]))
    return previous


# ---- kvpress


def cut(tokenizer, ids: list[int], sample) -> str:
    """kvpress's greedy ids cut as `answer` cuts ours: the cap, EOS (the worker stops there), every reference
    present, a line break after some text; postprocessed."""
    new: list[int] = []
    text = ""
    for token in ids[: sample.max_new_tokens]:
        if token in tokenizer.all_special_ids:
            break
        new.append(token)
        text = tokenizer.decode(new, skip_special_tokens=True)
        if all(r.lower() in text.lower() for r in sample.answers) or "\n" in text.lstrip():
            break
    return postprocess(text)


def run_theirs(model_dir, tokenizer, samples, press: str, ratio: float, threads: int) -> dict:
    prompts = [tokenizer(s.prompt)["input_ids"] for s in samples]
    out = run_kvpress(model_dir, prompts, press, ratio, max_new_tokens=max(s.max_new_tokens for s in samples),
                      dtype="float32", threads=threads)
    predictions = [cut(tokenizer, r["answer_ids"], s) for r, s in zip(out["results"], samples)]
    return {"out": out, "predictions": predictions,
            "scores": [score(s.metric, p, s.answers) for s, p in zip(samples, predictions)]}


# ---- figures


def summary(scores: list[float]) -> str:
    iv = interval(scores)
    return f"{100 * statistics.fmean(scores):.1f} [{iv.low:.0f}, {iv.high:.0f}]"


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean of a − b in points and its 95 % interval (Student's t; zero width when every difference is equal)."""
    d = [100 * (x - y) for x, y in zip(a, b)]
    mean = statistics.fmean(d)
    if len(d) < 2 or statistics.pstdev(d) == 0:
        return mean, mean, mean
    half = t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return mean, mean - half, mean + half


def jaccard(ours: list, theirs: list) -> float:
    """Mean over layers and KV heads of |A ∩ B| / |A ∪ B| of the kept positions."""
    values = [len(set(a) & set(b)) / len(set(a) | set(b))
              for layer_a, layer_b in zip(ours, theirs) for a, b in zip(layer_a, layer_b)]
    return statistics.fmean(values)


def answer_positions(tokenizer, sample) -> list[int]:
    """Token positions of the prompt that spell the answers (every occurrence of each reference: the needle's value,
    vt's chain of names)."""
    enc = tokenizer(sample.prompt, return_offsets_mapping=True)
    spans = []
    for ref in sample.answers:
        start = sample.prompt.find(ref)
        while start >= 0:
            spans.append((start, start + len(ref)))
            start = sample.prompt.find(ref, start + 1)
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and any(a < e and b > s for s, e in spans)]


def answer_kept(kept: list, positions: list[int]) -> float:
    """The fraction of the answer's token positions kept, averaged over layers and KV heads."""
    if not positions:
        return math.nan
    want = set(positions)
    return statistics.fmean(len(want & set(head)) / len(want) for layer in kept for head in layer)


def nested(ours: list, theirs: list) -> bool:
    """Whether, in every layer and KV head, kvpress's kept set lies inside ours and ours has at most one more (we keep
    ceil(T·(1 − r)) tokens, kvpress int(T·(1 − r)): the same choice, rounded the other way)."""
    return all(set(b) <= set(a) and len(a) - len(b) <= 1
               for layer_a, layer_b in zip(ours, theirs) for a, b in zip(layer_a, layer_b))


def per_layer_jaccard(ours_kept: list, theirs_kept: list) -> list[float]:
    layers = len(ours_kept[0])
    return [statistics.fmean(len(set(a) & set(b)) / len(set(a) | set(b))
                             for o, t in zip(ours_kept, theirs_kept) for a, b in zip(o[i], t[i]))
            for i in range(layers)]


def task_scores(samples, scores) -> str:
    groups: dict = {}
    for s, v in zip(samples, scores):
        groups.setdefault(s.task, []).append(v)
    return "; ".join(f"{t} {TaskScore.of(t, 0, v).score:.0f}" for t, v in groups.items())


class Writer:
    """CSV rows appended as they come (the header from the first row's keys, or from the file `keep` extends)."""

    def __init__(self, path: Path, keep: bool = False):
        self.path, self.fields = path, None
        if keep and path.exists():
            with path.open(newline="") as f:
                self.fields = next(csv.reader(f), None)
        else:
            path.unlink(missing_ok=True)

    def add(self, row: dict) -> None:
        new = self.fields is None
        if new:
            self.fields = list(row)
        with self.path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)


def pareto(rows: list[dict]) -> list[dict]:
    """Rows no other row beats (no more bytes and a higher score, or fewer bytes and no lower score)."""
    rows = sorted(rows, key=lambda r: (r["bytes_vs_fp16"], -r["score"]))
    out, best = [], -math.inf
    for r in rows:
        if r["score"] > best:
            out.append(r)
            best = r["score"]
    return out


def plot(rows: list[dict], reference: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for family, colour in (("quantization", "tab:blue"), ("eviction", "tab:orange"), ("both", "tab:green")):
        mine = [r for r in rows if r["family"] == family]
        if not mine:
            continue
        ax.scatter([r["bytes_vs_fp16"] for r in mine], [r["score"] for r in mine], color=colour, alpha=0.4, s=18)
        front = pareto(mine)
        ax.plot([r["bytes_vs_fp16"] for r in front], [r["score"] for r in front], "-o", color=colour, label=family)
        for r in front:
            ax.annotate(r["kind"], (r["bytes_vs_fp16"], r["score"]), fontsize=6, alpha=0.8)
    ax.axhline(reference["score"] - TARGET_POINTS, color="grey", ls="--", lw=0.8, label="fp16 − 2 points")
    ax.axvline(TARGET_BYTES, color="grey", ls=":", lw=0.8, label="0.15× fp16")
    ax.scatter([1.0], [reference["score"]], color="black", marker="*", s=80, label="fp16")
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes after prefill / fp16's (log)")
    ax.set_ylabel(f"average score over {reference['n']} samples")
    ax.set_title("eviction × quantization frontier")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_multikey_1", "vt"])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--count", type=int, default=3, help="samples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="cap on every answer, both sides")
    parser.add_argument("--ratio", type=float, default=0.5, help="part 1's compression ratio")
    parser.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    parser.add_argument("--skip-kvpress", action="store_true", help="part 1 without kvpress (ours only)")
    parser.add_argument("--skip-frontier", action="store_true", help="part 1 only")
    parser.add_argument("--best", type=int, default=2, help="methods of part 1 carried into the frontier")
    parser.add_argument("--methods", nargs="+", choices=list(PRESSES),
                        help="the frontier's eviction methods, chosen here: part 1 is skipped")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75, 0.875])
    parser.add_argument("--quant", nargs="+", default=["q8_0", "q4_0", "kivi4", "kivi2"])
    parser.add_argument("--stack", nargs="+", default=["q8_0:0.75", "q8_0:0.875", "q4_0:0.5", "q4_0:0.75",
                                                       "kivi4:0.5", "kivi4:0.75"],
                        help="kind:ratio pairs stacked with each best method")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/eviction_frontier")
    parser.add_argument("--quick", action="store_true", help="smoke: 1 niah_single_1 sample of 256 tokens, "
                        "knorm and snapkv, one ratio, one stacked kind")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.length, args.count, args.max_new_tokens = ["niah_single_1"], 256, 1, 12
        args.presses, args.best, args.ratios = ["knorm", "snapkv"], 1, [0.75]
        args.quant, args.stack = ["q4_0"], ["q8_0:0.75"]

    from runner.infer.loading.models import load_model
    from runner.infer.loading.zoo import zoo_model_dir

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    lm = load_model(args.model, dtype="float32", device="cpu")
    model, tok = lm.model, lm.tokenizer
    model_dir = zoo_model_dir(args.model) if args.model.startswith("zoo:") else args.model
    samples = capped([s for t in args.tasks for s in make_samples(t, tok, args.length, args.count, args.seed)],
                     args.max_new_tokens)
    n = len(samples)
    print(f"{args.model} fp32, {n} samples ({', '.join(args.tasks)} × {args.count}) at {args.length} tokens "
          f"(prompts {min(s.tokens for s in samples)}..{max(s.tokens for s in samples)}), answers ≤ "
          f"{args.max_new_tokens} tokens, torch threads {torch.get_num_threads()}", flush=True)
    setup = {"model": args.model, "tasks": args.tasks, "length": args.length, "count": args.count, "seed": args.seed,
             "max_new_tokens": args.max_new_tokens}
    previous = resumed(out, setup, samples)
    if previous:
        print(f"resuming: {len(previous)} answers of ours from {out}/samples.csv", flush=True)
    per_sample = Writer(out / "samples.csv", keep=bool(previous))
    done: dict[str, dict] = {}

    def ours(kinds: list[str], share: bool = False) -> None:
        todo = [kind for kind in dict.fromkeys(kinds) if kind not in done]
        if not todo:
            return
        t0 = time.perf_counter()
        def one(kind: str, r) -> None:
            per_sample.add({"side": "ours", "kind": kind, "task": r.sample.task, "index": r.sample.index,
                            "prompt_tokens": r.prompt_tokens, "score": r.score, "prediction": r.prediction,
                            "stop": r.stop, "prefill_s": round(r.prefill_s, 3), "decode_s": round(r.decode_s, 3),
                            "new_tokens": r.new_tokens, "cache_bytes": r.cache_bytes})

        for kind, got in run_ours(model, tok, samples, todo, share, one, previous).items():
            got["scores"] = [r.score for r in got["results"]]
            got["bytes"] = sum(r.cache_bytes for r in got["results"])
            got["shared"] = share and len(todo) > 1
            done[kind] = got
            print(f"  {kind}: {summary(got['scores'])} ({task_scores(samples, got['scores'])})", flush=True)
        print(f"  ({len(todo)} kind{'s' * (len(todo) > 1)}{', one prompt forward a sample' * got['shared']}: "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)

    print("\nreference", flush=True)
    ours(["fp16"])
    reference = done["fp16"]
    ref_bytes = reference["bytes"]

    # ---- part 1
    if not args.methods:
        print(f"\n1. ours against kvpress at ratio {args.ratio} (kvpress: the whole prompt as its context)",
              flush=True)
    compare = Writer(out / "compare.csv")
    compare_rows = []
    part1: dict[str, float] = {}
    for method in [] if args.methods else args.presses:
        ours([f"fp16+{method}:{args.ratio}"])
        mine = done[f"fp16+{method}:{args.ratio}"]
        part1[method] = statistics.fmean(mine["scores"])
        row = {"press": f"{method} / {PRESSES[method]}", "n": n, "ours": summary(mine["scores"])}
        ours_prefill = statistics.fmean(r.prefill_s for r in mine["results"])
        ours_ms = 1000 * sum(r.decode_s for r in mine["results"]) / max(1, sum(r.new_tokens for r in mine["results"]))
        if args.skip_kvpress:
            theirs = None
        else:
            t0 = time.perf_counter()
            theirs = run_theirs(model_dir, tok, samples, PRESSES[method], args.ratio, args.threads)
            for s, p, v, r in zip(samples, theirs["predictions"], theirs["scores"], theirs["out"]["results"]):
                per_sample.add({"side": "kvpress", "kind": PRESSES[method], "task": s.task, "index": s.index,
                                "prompt_tokens": r["context_tokens"], "score": v, "prediction": p, "stop": "",
                                "prefill_s": round(r["prefill_s"], 3), "decode_s": round(r["decode_s"], 3),
                                "new_tokens": len(r["answer_ids"]), "cache_bytes": ""})
            print(f"  kvpress {PRESSES[method]}: {summary(theirs['scores'])}, {time.perf_counter() - t0:.0f} s "
                  f"with start-up", flush=True)
        spans = [answer_positions(tok, s) for s in samples]
        if all(k is not None for k in mine["kept"]):
            kept_share = statistics.fmean(answer_kept(k, p) for k, p in zip(mine["kept"], spans))
            row["answer tokens kept ours"] = f"{kept_share:.2f}"
        if theirs is not None:
            res = theirs["out"]["results"]
            if all(r["kept"] for r in res):
                row["answer tokens kept kvpress"] = (
                    f"{statistics.fmean(answer_kept(r['kept'], p) for r, p in zip(res, spans)):.2f}")
            diff, low, high = paired(mine["scores"], theirs["scores"])
            same = sum(a.prediction == b for a, b in zip(mine["results"], theirs["predictions"]))
            has_kept = all(k is not None for k in mine["kept"]) and all(r["kept"] for r in res)
            row.update({
                "kvpress": summary(theirs["scores"]), "ours − kvpress [95 %]": f"{diff:+.1f} [{low:+.0f}, {high:+.0f}]",
                "same answers": f"{same}/{n}",
                "kept Jaccard": (f"{statistics.fmean(jaccard(k, r['kept']) for k, r in zip(mine['kept'], res)):.3f}"
                                 if has_kept else "n/a"),
                "Jaccard per layer (min..max)": "",
                "kvpress's ⊆ ours, ≤ 1 more": (f"{sum(nested(k, r['kept']) for k, r in zip(mine['kept'], res))}/{n}"
                                               if has_kept else "n/a"),
                "prefill s ours / kvpress": f"{ours_prefill:.1f} / {statistics.fmean(r['prefill_s'] for r in res):.1f}",
                "decode ms/token ours / kvpress": f"{ours_ms:.0f} / "
                f"{1000 * sum(r['decode_s'] for r in res) / max(1, sum(len(r['answer_ids']) for r in res)):.0f}",
                "peak MiB added ours / kvpress": f"{mine['peak'] / 2**20:.0f} / "
                f"{max(r.get('peak_rss_added') or 0 for r in res) / 2**20:.0f}"})
            if has_kept:
                layers = per_layer_jaccard(mine["kept"], [r["kept"] for r in res])
                row["Jaccard per layer (min..max)"] = (f"{min(layers):.2f} (layer {layers.index(min(layers))})"
                                                       f"..{max(layers):.2f}")
        else:
            row.update({"prefill s ours": f"{ours_prefill:.1f}", "decode ms/token ours": f"{ours_ms:.0f}",
                        "peak MiB added ours": f"{mine['peak'] / 2**20:.0f}"})
        compare.add(row)
        compare_rows.append(row)
    print_table(compare_rows)
    if args.skip_frontier:
        return

    # ---- part 2
    best = args.methods or sorted(part1, key=lambda m: (-part1[m], PREFERENCE.index(m)))[: args.best]
    print(f"\n2. the frontier ({'methods' if args.methods else f'best methods at ratio {args.ratio}'}: "
          f"{', '.join(best)})", flush=True)
    configs = [("reference", "fp16")] + [("quantization", k) for k in args.quant]
    configs += [("eviction", f"fp16+{m}:{r}") for m in best for r in args.ratios]
    configs += [("both", f"{pair.rsplit(':', 1)[0]}+{m}:{pair.rsplit(':', 1)[1]}") for m in best for pair in args.stack]
    ours([kind for family, kind in configs if family in ("eviction", "both")], share=True)  # first: item 8's question
    ours([kind for family, kind in configs if family == "quantization"])
    frontier = Writer(out / "frontier.csv")
    rows = []
    for family, kind in configs:
        got = done[kind]
        iv = interval(got["scores"])
        row = {"family": family, "kind": kind, "bytes_vs_fp16": got["bytes"] / ref_bytes,
               "score": 100 * statistics.fmean(got["scores"]), "low": iv.low, "high": iv.high, "n": n,
               "Δ vs fp16": 100 * statistics.fmean(got["scores"]) - 100 * statistics.fmean(reference["scores"]),
               "per task": task_scores(samples, got["scores"]),
               "prefill_s": statistics.fmean(r.prefill_s for r in got["results"]),
               "peak_mib_added": "shared" if got["shared"] else got["peak"] / 2**20}
        frontier.add(row)
        rows.append(row)
    ref_row = rows[0]
    print_frontier(rows)
    plot(rows[1:], ref_row, out / "frontier.png")
    verdict(rows, ref_row)
    print(f"\nwrote {out}/compare.csv, frontier.csv, samples.csv, frontier.png; {time.perf_counter() - started:.0f} s",
          flush=True)


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    sys.stdout.flush()


def print_frontier(rows: list[dict]) -> None:
    fronts = {f: {id(r) for r in pareto([r for r in rows if r["family"] == f])}
              for f in ("quantization", "eviction", "both")}
    print("\n| family | kind | bytes vs fp16 | average score [95 %] | n | Δ vs fp16 | per task | on its frontier |"
          "\n|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["family"] != "reference", r["bytes_vs_fp16"])):
        on = "yes" if id(r) in fronts.get(r["family"], set()) else ""
        print(f"| {r['family']} | {r['kind']} | {r['bytes_vs_fp16']:.3f} | {r['score']:.1f} [{r['low']:.0f}, "
              f"{r['high']:.0f}] | {r['n']} | {r['Δ vs fp16']:+.1f} | {r['per task']} | {on} |")
    sys.stdout.flush()


def verdict(rows: list[dict], ref: dict) -> None:
    """Item 8's target, said plainly."""
    small = [r for r in rows if r["family"] == "both" and r["bytes_vs_fp16"] <= TARGET_BYTES]
    print(f"\ntarget: ≤ {TARGET_BYTES}× fp16's bytes, within {TARGET_POINTS} points of fp16 ({ref['score']:.1f}), "
          "beating the best quantization alone and the best eviction alone at no more bytes")
    if not small:
        print("  no stacked configuration at ≤ 0.15×: target not measured")
        return
    for r in sorted(small, key=lambda r: -r["score"]):
        within = r["score"] >= ref["score"] - TARGET_POINTS
        alone = {f: max((o["score"] for o in rows if o["family"] == f and o["bytes_vs_fp16"] <= r["bytes_vs_fp16"]),
                        default=None) for f in ("quantization", "eviction")}
        beats = all(v is None or r["score"] > v for v in alone.values())
        met = "MET" if within and beats else "missed"
        shown = {f: "none" if v is None else f"{v:.1f}" for f, v in alone.items()}
        print(f"  {r['kind']}: {r['bytes_vs_fp16']:.3f}×, {r['score']:.1f} [{r['low']:.0f}, {r['high']:.0f}] "
              f"(n {r['n']}, Δ {r['Δ vs fp16']:+.1f}); best quantization alone at ≤ its bytes: "
              f"{shown['quantization']}, best eviction alone: {shown['eviction']} → {met}")


if __name__ == "__main__":
    main()
