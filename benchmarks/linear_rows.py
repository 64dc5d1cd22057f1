"""runner's few-row product kernel (runner::linear_rows) vs aten's, over a real model's Linear weights in the order
a decode step reads them: one process, interleaved, the weights streamed from memory as in a step (not cache-warm).

    python benchmarks/linear_rows.py [--model zoo:smollm2-135m] [--dtypes float32 bfloat16] [--rows 1 4]

Prints per dtype and rows: median milliseconds to run every Linear once, the read rate (weight bytes / time), that
rate's fraction of the measured copy bandwidth, and the ratio aten ÷ ours (> 1: ours faster). "ours" is the widest
path this CPU has (64-byte loads for float32 and vdpbf16ps for bfloat16 with AVX-512); "avx2" the path every AVX2 CPU
takes, timed in the same rounds (avx2÷ours: what the wider path buys here; 1 where the CPU has no wider one);
"grouped" ours again with q, k, v and gate, up in one call each (runner::linear_rows_group, as the native step calls
them; ours÷grouped > 1: grouping faster); "4k" grouped again on a copy of the weights on 4 KiB pages (the model's own
are on huge pages where the system allows: heap.onto_huge_pages; 4k÷grouped > 1: huge pages faster). The largest
difference between aten's and ours is printed beside, as a fraction of the largest |output|.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from runner.infer.kernels import cpu_linear, heap  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.measure.timing import copy_bandwidth, time_interleaved  # noqa: E402

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # products of one x, as the native step groups


def grouped_weights(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """Every Linear's weight in module order, q, k, v and gate, up of a module together, the others alone."""
    groups: list[list[torch.Tensor]] = []
    for parent in model.modules():
        children = dict(parent.named_children())
        taken = {name for group in GROUPS if all(isinstance(children.get(n), torch.nn.Linear) for n in group)
                 for name in group}
        for group in GROUPS:
            if set(group) <= taken:
                groups.append([children[n].weight.detach() for n in group])
        groups += [[child.weight.detach()] for name, child in children.items()
                   if isinstance(child, torch.nn.Linear) and name not in taken]
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if not cpu_linear.load():
        raise SystemExit("runner's linear kernel is not available here (see the log): nothing to compare")
    bandwidth = copy_bandwidth(torch.device("cpu"))
    print(f"model={args.model} threads={torch.get_num_threads()} copy={bandwidth / 1e9:.1f} GB/s "
          f"torch={torch.__version__}")
    print(f"{'dtype':>9} {'rows':>4} {'aten ms':>8} {'ours ms':>8} {'aten GB/s':>9} {'ours GB/s':>9} "
          f"{'ours bw':>7} {'aten÷ours':>9} {'avx2 ms':>8} {'avx2÷ours':>9} {'grouped ms':>10} "
          f"{'ours÷grouped':>12} {'4k ms':>7} {'4k÷grouped':>10} {'max diff':>8}")
    for dtype in args.dtypes:
        model = load_model(args.model, dtype=dtype).model
        weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
        groups = grouped_weights(model)
        small = copy.deepcopy(model)
        heap.onto_huge_pages(small, huge=False)
        small_groups = grouped_weights(small)
        gigabytes = sum(w.numel() * w.element_size() for w in weights) / 1e9
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, dtype=model.dtype) for k in {w.shape[1] for w in weights}}

            def aten(tick):
                for w in weights:
                    torch.nn.functional.linear(inputs[w.shape[1]], w)
                tick()

            def ours(tick):
                for w in weights:
                    torch.ops.runner.linear_rows(inputs[w.shape[1]], w.t(), None)
                tick()

            def avx2(tick):
                for w in weights:
                    torch.ops.runner.linear_rows(inputs[w.shape[1]], w.t(), None, False)
                tick()

            def grouped(tick, groups=groups):
                for group in groups:
                    torch.ops.runner.linear_rows_group(inputs[group[0].shape[1]], [w.t() for w in group],
                                                       [None] * len(group))
                tick()

            def grouped_4k(tick):
                grouped(tick, small_groups)

            with torch.inference_mode():
                variants = {"aten": aten, "ours": ours, "avx2": avx2, "grouped": grouped, "4k": grouped_4k}
                marks = time_interleaved(variants, args.repeats)
                diff = max(((torch.nn.functional.linear(inputs[w.shape[1]], w).float()
                             - torch.ops.runner.linear_rows(inputs[w.shape[1]], w.t(), None).float()).abs().max()
                            / torch.nn.functional.linear(inputs[w.shape[1]], w).float().abs().max()).item()
                           for w in weights)
            seconds = {name: statistics.median(m[-1] for m in runs) for name, runs in marks.items()}
            ratio, wider, together = (statistics.median(a[-1] / o[-1] for a, o in zip(marks[name], marks["ours"]))
                                      for name in ("aten", "avx2", "grouped"))
            paged = statistics.median(a[-1] / g[-1] for a, g in zip(marks["4k"], marks["grouped"]))
            print(f"{dtype:>9} {rows:>4} {seconds['aten'] * 1e3:>8.1f} {seconds['ours'] * 1e3:>8.1f} "
                  f"{gigabytes / seconds['aten']:>9.1f} {gigabytes / seconds['ours']:>9.1f} "
                  f"{gigabytes / seconds['ours'] / (bandwidth / 1e9):>7.2f} {ratio:>9.2f} "
                  f"{seconds['avx2'] * 1e3:>8.1f} {wider:>9.2f} "
                  f"{seconds['grouped'] * 1e3:>10.1f} {1 / together:>12.2f} {seconds['4k'] * 1e3:>7.1f} {paged:>10.2f} "
                  f"{diff:>8.1e}", flush=True)
        del model, small


if __name__ == "__main__":
    main()
