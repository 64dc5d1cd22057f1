"""runner's products on GGUF blocks (runner::gguf_rows, each type) vs runner::linear_rows and aten's mm on float32
weights, at SmolLM2-135M's shapes: one process, interleaved, the weights streamed from memory as in a decode step
(each variant cycles through copies of its weight that together exceed the last-level cache, 64 MB at the least).

    python benchmarks/gguf_rows.py [--rows 1 4] [--types Q4_0 …] [--repeats 7] [--threads N] [--streamed-mb 64]

The K-quants (256-element blocks) run where K is a multiple of 256: K = 1536 and 4864. Prints per shape (N, K)
and rows M: for each variant the median microseconds a product takes, the read rate (its
weight bytes / time) and the speed-up over linear_rows on float32 (> 1: faster). Then, from those times, the
products of one SmolLM2-135M decode step as llama.cpp's Q4_1 file stores it (Q4_1 layers, Q8_0 tied head) and as
tokens/s, to set beside llama-bench's decode rate (the step's other work not counted).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from runner.infer.kernels import cpu_linear, gguf_rows
from runner.infer.measure.timing import copy_bandwidth, time_interleaved

# SmolLM2-135M's (N, K), and Qwen2.5-0.5B's down projection (K = 4864: a whole number of the K-quants' 256)
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (896, 4864)]
PER_LAYER = {(576, 576): 2, (192, 576): 2, (1536, 576): 2, (576, 1536): 1}  # q o, k v, gate up, down; 30 layers
LAYERS = 30
STREAMED_BYTES = 64 * 2**20  # each variant's copies together: twice a 32 MB L3


def random_blocks(ggml_type: int, rows: int, k: int, generator: np.random.Generator) -> torch.Tensor:
    """uint8 [rows, row_bytes] of random bytes with every fp16 scale set to 2⁻⁸ (finite; speed does not depend on
    the values)."""
    size = gguf_rows.BLOCK_BYTES[ggml_type]
    blocks = generator.integers(0, 256, (rows, k // gguf_rows.BLOCK_ELEMS[ggml_type], size), dtype=np.uint8)
    half = np.array([2.0**-8], dtype=np.float16).view(np.uint8)
    for at in {2: (0,), 3: (0, 2), 6: (0,), 8: (0,), 12: (0, 2), 14: (208,)}[ggml_type]:
        blocks[..., at:at + 2] = half
    return torch.from_numpy(blocks.reshape(rows, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--types", nargs="+", default=list(gguf_rows.GGML_TYPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--streamed-mb", type=int, default=STREAMED_BYTES // 2**20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (gguf_rows.load() and cpu_linear.load()):
        raise SystemExit("runner's kernels are not available here (see the log): nothing to compare")
    bandwidth = copy_bandwidth(torch.device("cpu"))
    print(f"threads={torch.get_num_threads()} copy={bandwidth / 1e9:.1f} GB/s paths={gguf_rows.paths()} "
          f"torch={torch.__version__}")
    generator = np.random.default_rng(0)
    seconds: dict[tuple[int, int, int, str], float] = {}
    for n, k in SHAPES:
        types = [name for name in args.types if k % gguf_rows.BLOCK_ELEMS[gguf_rows.GGML_TYPES[name]] == 0]
        smallest = min(gguf_rows.row_bytes(name, k) for name in types) * n
        copies = max(1, -(-args.streamed_mb * 2**20 // smallest))
        weights = {name: random_blocks(gguf_rows.GGML_TYPES[name], copies * n, k, generator) for name in types}
        floats = torch.randn(copies * n, k)
        interleaved = {name: torch.ops.runner.gguf_interleave(weights[name], gguf_rows.GGML_TYPES[name])
                       for name in types if gguf_rows.interleavable(gguf_rows.GGML_TYPES[name], n)}
        bytes_read = {name: w.numel() // copies for name, w in weights.items()}
        bytes_read |= {f"{name} x8": bytes_read[name] for name in interleaved}  # the same bytes, reordered
        bytes_read |= {"linear_rows f32": n * k * 4, "aten mm f32": n * k * 4}
        for rows in args.rows:
            x = torch.randn(rows, k)
            variants = {name: _cycle(copies, n, lambda w, name=name: torch.ops.runner.gguf_rows(
                x, w, gguf_rows.GGML_TYPES[name]), weights[name]) for name in types}
            for name, blocks in interleaved.items():
                variants[f"{name} x8"] = _cycle(copies, n, lambda w, name=name: torch.ops.runner.gguf_rows(
                    x, w, gguf_rows.GGML_TYPES[name], 0, True), blocks)
            variants["linear_rows f32"] = _cycle(copies, n, lambda w: torch.ops.runner.linear_rows(x, w.t(), None),
                                                 floats)
            variants["aten mm f32"] = _cycle(copies, n, lambda w: torch.nn.functional.linear(x, w), floats)
            with torch.inference_mode():
                marks = time_interleaved(variants, args.repeats)
            print(f"\nN={n} K={k} M={rows} ({copies} copies streamed)")
            print(f"{'variant':>16} {'µs':>8} {'GB/s':>6} {'vs f32 linear_rows':>18}")
            base = statistics.median(m[-1] for m in marks["linear_rows f32"]) / copies
            for name, runs in marks.items():
                each = statistics.median(m[-1] for m in runs) / copies
                seconds[(n, k, rows, name)] = each
                print(f"{name:>16} {each * 1e6:>8.1f} {bytes_read[name] / each / 1e9:>6.1f} {base / each:>18.2f}")
        del weights, interleaved, floats
    for rows in args.rows:
        if "Q4_1" in args.types and "Q8_0" in args.types:
            head = seconds[(49152, 576, rows, "Q8_0")]
            step, step_x8 = (head + LAYERS * sum(count * seconds[(*shape, rows, layout)] for shape, count
                                                 in PER_LAYER.items()) for layout in ("Q4_1", "Q4_1 x8"))
            f32 = LAYERS * sum(count * seconds[(*shape, rows, "linear_rows f32")] for shape, count in PER_LAYER.items())
            f32 += seconds[(49152, 576, rows, "linear_rows f32")]
            print(f"\nSmolLM2-135M step's products, M={rows}: Q4_1 layers + Q8_0 head {step * 1e3:.2f} ms "
                  f"({1 / step:.0f} steps/s), interleaved {step_x8 * 1e3:.2f} ms ({1 / step_x8:.0f} steps/s); "
                  f"float32 linear_rows {f32 * 1e3:.2f} ms ({1 / f32:.0f} steps/s)")


def _cycle(copies: int, n: int, product, weights: torch.Tensor):
    """A timed run: the product once on each copy of the weight (rows i·n … (i+1)·n of `weights`)."""
    parts = [weights[i * n:(i + 1) * n] for i in range(copies)]

    def run_once(tick) -> None:
        for part in parts:
            product(part)
        tick()

    return run_once


if __name__ == "__main__":
    main()
