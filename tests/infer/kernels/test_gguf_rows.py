"""runner::gguf_rows / gguf_dequantize (gguf_rows): products on GGUF blocks against float64 on gguf's dequantized
weights within a bound derived from x's quantization, every type × every path this build has; dequantization equal to
gguf.quants.dequantize; the paths equal within float32 rounding; errors; tracing under torch.compile."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from runner.infer.kernels import gguf_rows
from tests.machine import missing

pytestmark = pytest.mark.skipif(not gguf_rows.load(), reason="runner's C++ kernels are not built here (no compiler)")

TYPES = list(gguf_rows.GGML_TYPES)
# The fp16 scales in each block (byte offsets): random bytes there could be NaN or Inf, so tests write finite ones.
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
SMOLLM2 = Path("/root/.cache/runner/gguf/smollm2-135m.gguf")
QWEN = Path("/root/.cache/runner/gguf/qwen2.5-coder-0.5b.gguf")


def _path_param(path: int, flags: tuple[str, ...]):
    name = gguf_rows.PATH_NAMES[path]
    built = path in gguf_rows.paths()
    reason = missing(*flags) or f"this build of gguf_rows has no {name} path"
    return pytest.param(path, id=name, marks=pytest.mark.skipif(not built, reason=reason))


PATHS = [_path_param(1, ()), _path_param(2, ("avx2", "fma")), _path_param(3, ("avx512f", "avx512bw"))]


def _shapes(name: str) -> list[tuple[int, int]]:
    """(N, K): N not a multiple of 8 or 16 (each thread's run of rows ends mid-way), K one block to several."""
    block = gguf_rows.BLOCK_ELEMS[gguf_rows.GGML_TYPES[name]]
    return [(7, block), (37, 512), (20, 1536)] if block == 256 else [(7, 32), (37, 576), (20, 1536)]


def random_blocks(name: str, n: int, k: int, generator: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes] of random bytes (every quant value and 6-bit scale occurs) with finite fp16 scales of
    either sign, small enough that products stay far from float32's range."""
    number = gguf_rows.GGML_TYPES[name]
    size = gguf_rows.BLOCK_BYTES[number]
    blocks = generator.integers(0, 256, (n, k // gguf_rows.BLOCK_ELEMS[number], size), dtype=np.uint8)
    for at in HALF_FIELDS[name]:
        scales = (generator.uniform(-1, 1, blocks.shape[:2]) * 2.0 ** generator.integers(-12, -4, blocks.shape[:2]))
        blocks[..., at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(n, -1)


def dequantized(blocks: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name]).copy())


X_LEVELS = {"Q8_0": 32767}  # x quantized to 16 bits (the de-quantized model's greedy tokens); the others: 127


def error_bound(x: torch.Tensor, w: torch.Tensor, block: int, levels: int = 127) -> torch.Tensor:
    """|y − x·wᵀ| allowed: each x is quantized per block of `block` to q·d with d = max|x|/levels (float32), so its
    error is at most d/2 and a block adds at most (d/2)·Σ|w| over it; the sums are float32 (1e-5 of Σ|x·w|, over the
    quantized x as well)."""
    m, k = x.shape
    d = x.double().abs().reshape(m, k // block, block).amax(-1) / levels
    w_block = w.double().abs().reshape(w.shape[0], k // block, block).sum(-1)
    quantization = (d / 2) @ w_block.t()
    return quantization + 1e-5 * (x.double().abs() @ w.double().abs().t() + quantization)


def check_product(x: torch.Tensor, blocks: np.ndarray, name: str, path: int, interleaved: bool = False) -> torch.Tensor:
    """gguf_rows on the plain blocks (or on them interleaved) against float64 on gguf's dequantization."""
    number = gguf_rows.GGML_TYPES[name]
    stored = torch.from_numpy(blocks)
    if interleaved:
        stored = torch.ops.runner.gguf_interleave(stored, number)
    got = torch.ops.runner.gguf_rows(x, stored, number, path, interleaved)
    w = dequantized(blocks, name)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], w.shape[0])
    bound = error_bound(x, w, gguf_rows.BLOCK_ELEMS[number], X_LEVELS.get(name, 127))
    excess = (got.double() - want).abs() - bound
    assert (excess <= 0).all(), f"{name} path {path}: exceeds the bound by up to {excess.max().item():.3g}"
    return got


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 17])
def test_products_match_float64_within_xs_quantization(name, path, rows):
    generator = np.random.default_rng([rows, gguf_rows.GGML_TYPES[name]])
    for n, k in _shapes(name):
        x = torch.from_numpy(generator.standard_normal((rows, k)).astype(np.float32))
        check_product(x, random_blocks(name, n, k, generator), name, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", [name for name in TYPES if not name.endswith("_K")])
def test_products_on_weights_gguf_quantized(name, path):
    """Blocks as a quantizer writes them (gguf.quants.quantize; it has no K-quants), x with one large outlier."""
    generator = np.random.default_rng(gguf_rows.GGML_TYPES[name])
    weights = generator.standard_normal((45, 640)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[name])
    x = torch.from_numpy(generator.standard_normal((3, 640)).astype(np.float32))
    x[1, 5] = 40.0
    check_product(x, blocks, name, path)


def _real_tensors():
    """(name, blocks) of one real tensor per type in the cached GGUF files (SmolLM2: Q4_1, Q8_0; Qwen2.5-Coder:
    Q5_0, Q4_K, Q6_K), at most 300 rows each."""
    found = {}
    for file in (SMOLLM2, QWEN):
        if file.is_file():
            for tensor in gguf.GGUFReader(file).tensors:
                name = tensor.tensor_type.name
                if name in gguf_rows.GGML_TYPES and name not in found:
                    found[name] = np.array(tensor.data[:300])  # a writable copy
    return found


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", TYPES)
def test_a_group_of_plain_weights_equals_its_products_one_by_one(name, path):
    """gguf_rows_group(..., interleaved=False): x quantized once and all the weights' rows in one parallel region,
    the same arithmetic per row whichever thread takes it: equal, not close."""
    generator = np.random.default_rng(gguf_rows.GGML_TYPES[name] + 40)
    k = 512 if name.endswith("_K") else 576
    weights = [torch.from_numpy(random_blocks(name, n, k, generator)) for n in (37, 16, 1, 64)]
    x = torch.randn(5, k)
    group = torch.ops.runner.gguf_rows_group(x, weights, gguf_rows.GGML_TYPES[name], path, False)
    assert [tuple(y.shape) for y in group] == [(5, 37), (5, 16), (5, 1), (5, 64)]
    for y, w in zip(group, weights, strict=True):
        assert torch.equal(y, torch.ops.runner.gguf_rows(x, w, gguf_rows.GGML_TYPES[name], path))


@pytest.mark.parametrize("path", PATHS)
def test_real_gguf_tensors(path):
    tensors = _real_tensors()
    if not tensors:
        pytest.skip(f"neither {SMOLLM2} nor {QWEN} is cached")
    generator = np.random.default_rng(1)
    for name, blocks in tensors.items():
        k = blocks.shape[1] // gguf_rows.BLOCK_BYTES[gguf_rows.GGML_TYPES[name]] * gguf_rows.BLOCK_ELEMS[
            gguf_rows.GGML_TYPES[name]]
        x = torch.from_numpy(generator.standard_normal((4, k)).astype(np.float32))
        check_product(x, blocks, name, path)
        assert torch.equal(torch.ops.runner.gguf_dequantize(torch.from_numpy(blocks), gguf_rows.GGML_TYPES[name]),
                           dequantized(blocks, name))


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_equals_gguf(name):
    generator = np.random.default_rng(gguf_rows.GGML_TYPES[name] + 100)
    for n, k in _shapes(name):
        blocks = random_blocks(name, n, k, generator)
        got = torch.ops.runner.gguf_dequantize(torch.from_numpy(blocks), gguf_rows.GGML_TYPES[name])
        assert got.dtype == torch.float32 and torch.equal(got, dequantized(blocks, name)), (name, n, k)


@pytest.mark.parametrize("name", TYPES)
def test_paths_agree_within_float32_rounding(name):
    """Every path sums the same integers; only the order of the float32 sums differs."""
    built = list(gguf_rows.paths())
    if len(built) < 2:
        pytest.skip(f"one path only in this build ({built})")
    generator = np.random.default_rng(gguf_rows.GGML_TYPES[name] + 200)
    n, k = _shapes(name)[-1]
    blocks = random_blocks(name, n, k, generator)
    x = torch.from_numpy(generator.standard_normal((5, k)).astype(np.float32))
    number = gguf_rows.GGML_TYPES[name]
    results = [torch.ops.runner.gguf_rows(x, torch.from_numpy(blocks), number, path) for path in built]
    block = gguf_rows.BLOCK_ELEMS[number]  # |quantized x| ≤ |x| + d/2, d = its block's max|x|/127
    half_step = x.abs().reshape(5, k // block, block).amax(-1, keepdim=True) / 254
    quantized = (x.abs().reshape(5, k // block, block) + half_step).reshape(5, k)
    magnitude = quantized.double() @ dequantized(blocks, name).double().abs().t()
    for path, result in zip(built[1:], results[1:], strict=True):
        assert ((result.double() - results[0].double()).abs() <= 1e-5 * magnitude).all(), (name, path)
    assert torch.equal(torch.ops.runner.gguf_rows(x, torch.from_numpy(blocks), number), results[-1])  # 0: the best


@pytest.mark.parametrize("case, pattern", [
    ("float64 x", "x must be float32"), ("int8 blocks", "blocks must be contiguous uint8"),
    ("K not whole blocks", "not a multiple of Q8_0's block"), ("row_bytes mismatch", "row_bytes 68 does not match"),
    ("unknown type", "ggml type 7 is not one"), ("path 9", "path 9 is none of"),
    ("transposed blocks", "blocks must be contiguous")])
def test_bad_input_is_an_error_saying_so(case, pattern):
    x, blocks = torch.randn(2, 64), torch.zeros(5, 68, dtype=torch.uint8)  # two Q8_0 blocks a row
    args = {"float64 x": (x.double(), blocks, 8), "int8 blocks": (x, blocks.to(torch.int8), 8),
            "K not whole blocks": (torch.randn(2, 48), torch.zeros(5, 51, dtype=torch.uint8), 8),
            "row_bytes mismatch": (torch.randn(2, 96), blocks, 8), "unknown type": (x, blocks, 7),
            "path 9": (x, blocks, 8, 9), "transposed blocks": (x, torch.zeros(68, 5, dtype=torch.uint8).t(), 8)}[case]
    with pytest.raises(RuntimeError, match=f"gguf_rows: .*{pattern}"):
        torch.ops.runner.gguf_rows(*args)


@pytest.mark.parametrize("path", [2, 3])
def test_a_path_not_built_is_an_error(path):
    if path in gguf_rows.paths():
        pytest.skip(f"this build has the {gguf_rows.PATH_NAMES[path]} path")
    with pytest.raises(RuntimeError, match=f"gguf_rows: path {path} .* is not built"):
        torch.ops.runner.gguf_rows(torch.randn(1, 32), torch.zeros(1, 34, dtype=torch.uint8), 8, path)


def test_format_table():
    assert gguf_rows.row_bytes("Q4_K", 512) == 288 and gguf_rows.row_bytes(8, 576) == 612
    for name, number in gguf_rows.GGML_TYPES.items():
        ggml = gguf.GGMLQuantizationType[name]
        assert number == ggml.value
        assert (gguf_rows.BLOCK_ELEMS[number], gguf_rows.BLOCK_BYTES[number]) == gguf.GGML_QUANT_SIZES[ggml]
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        gguf_rows.row_bytes("Q6_K", 576)
    with pytest.raises(ValueError, match="not one gguf_rows reads"):
        gguf_rows.row_bytes("Q2_K", 256)
    assert 1 in gguf_rows.paths() and set(gguf_rows.paths()) <= set(gguf_rows.PATH_NAMES)


def test_traces_under_torch_compile():
    """fullgraph: the ops' fakes give the shapes, so a step calling them compiles without a graph break."""
    generator = np.random.default_rng(7)
    blocks = torch.from_numpy(random_blocks("Q4_K", 24, 512, generator))
    x = torch.randn(3, 512)

    def step(x, blocks):
        embedded = torch.ops.runner.gguf_dequantize(blocks[:2], 12)
        return torch.ops.runner.gguf_rows(x + embedded.sum(0), blocks, 12).relu()

    compiled = torch.compile(step, fullgraph=True)
    assert torch.allclose(compiled(x, blocks), step(x, blocks), rtol=1e-5, atol=1e-5)
