"""runner::gguf_interleave / gguf_rows(..., interleaved=True) / gguf_rows_group (gguf_interleaved.cpp) and the
compiled step's rewrite into groups (gguf_rows.group_products): the interleaved layout holds the file's bytes, its
products stay within the bound of x's quantization against float64, a group equals its products one by one, and
wrong input is an error saying so."""

import numpy as np
import pytest
import torch

from runner.infer.kernels import cpu_linear, gguf_rows
from tests.infer.kernels.test_gguf_rows import PATHS, check_product, random_blocks

pytestmark = pytest.mark.skipif(not gguf_rows.load(), reason="runner's C++ kernels are not built here (no compiler)")

NAMES = ["Q4_0", "Q4_1", "Q5_0"]
SHAPES = [(8, 32), (40, 576), (24, 1536)]  # (N, K): one span to several, K one block to many


def interleaved(blocks: np.ndarray, name: str) -> torch.Tensor:
    return torch.ops.runner.gguf_interleave(torch.from_numpy(blocks), gguf_rows.GGML_TYPES[name])


@pytest.mark.parametrize("name", NAMES)
def test_interleaving_reorders_each_span_of_8_rows_bytes(name):
    generator = np.random.default_rng(gguf_rows.GGML_TYPES[name])
    blocks = random_blocks(name, 24, 576, generator)
    got = interleaved(blocks, name).numpy()
    assert got.shape == blocks.shape and got.dtype == np.uint8 and not np.array_equal(got, blocks)
    for span in range(3):  # the same bytes within each span, none crossing to another
        rows = slice(8 * span, 8 * span + 8)
        assert np.array_equal(np.sort(got[rows], axis=None), np.sort(blocks[rows], axis=None))


@pytest.mark.parametrize("name", NAMES)
def test_span_rows_read_interleaved_rows_back_as_the_file_stores_them(name):
    generator = np.random.default_rng(gguf_rows.GGML_TYPES[name] + 60)
    blocks = random_blocks(name, 24, 576, generator)
    ids = torch.tensor([0, 7, 8, 23, 13, 13])
    got = torch.ops.runner.gguf_span_rows(interleaved(blocks, name), ids, gguf_rows.GGML_TYPES[name])
    assert np.array_equal(got.numpy(), blocks[ids.numpy()])
    with pytest.raises(RuntimeError, match="gguf_span_rows: id 24 is not a row of 24"):
        torch.ops.runner.gguf_span_rows(interleaved(blocks, name), torch.tensor([24]), gguf_rows.GGML_TYPES[name])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_interleaved_products_match_float64_within_xs_quantization(name, path, rows):
    generator = np.random.default_rng([rows, gguf_rows.GGML_TYPES[name], 8])
    for n, k in SHAPES:
        x = torch.from_numpy(generator.standard_normal((rows, k)).astype(np.float32))
        blocks = random_blocks(name, n, k, generator)
        check_product(x, blocks, name, path, interleaved=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", NAMES)
def test_a_group_equals_its_products_one_by_one(name, path):
    """The same arithmetic per row whichever thread takes it: equal, not close."""
    generator = np.random.default_rng(gguf_rows.GGML_TYPES[name] + 30)
    number = gguf_rows.GGML_TYPES[name]
    weights = [interleaved(random_blocks(name, n, 576, generator), name) for n in (40, 16, 8, 64)]
    x = torch.randn(3, 576)
    group = torch.ops.runner.gguf_rows_group(x, weights, number, path)
    assert [tuple(y.shape) for y in group] == [(3, 40), (3, 16), (3, 8), (3, 64)]
    for y, w in zip(group, weights, strict=True):
        assert torch.equal(y, torch.ops.runner.gguf_rows(x, w, number, path, True))


@pytest.mark.parametrize("case, pattern", [
    ("Q8_0", "only Q4_0 \\(2\\), Q4_1 \\(3\\) and Q5_0 \\(6\\) are read interleaved"),
    ("12 rows", "12 rows are not a whole number of them"),
    ("group of other K", "row_bytes 180 does not match K = 576")])
def test_what_cannot_be_interleaved_is_an_error_saying_so(case, pattern):
    generator = np.random.default_rng(5)
    if case == "Q8_0":
        call = lambda: torch.ops.runner.gguf_interleave(torch.from_numpy(random_blocks("Q8_0", 8, 64, generator)), 8)
    elif case == "12 rows":
        blocks = torch.from_numpy(random_blocks("Q4_1", 12, 64, generator))
        call = lambda: torch.ops.runner.gguf_rows(torch.randn(1, 64), blocks, 3, 0, True)
    else:
        weights = [interleaved(random_blocks("Q4_1", 8, k, generator), "Q4_1") for k in (576, 288)]
        call = lambda: torch.ops.runner.gguf_rows_group(torch.randn(1, 576), weights, 3)
    with pytest.raises(RuntimeError, match=pattern):
        call()


@pytest.mark.compile
@pytest.mark.skipif(not cpu_linear.load(), reason="the compiled step's pass (cpu_linear.OwnProducts) needs AVX2 + FMA")
def test_a_compiled_step_reads_products_of_one_x_as_a_group():
    """q, k, v-like products of one hidden state (each on its own view, as Linears make them) become one group; a
    product of another x stays alone; the results are the eager ones exactly."""
    generator = np.random.default_rng(11)
    q, k, v, o = (interleaved(random_blocks("Q4_1", n, 64, generator), "Q4_1") for n in (64, 16, 16, 64))

    def step(hidden):
        rows = [torch.ops.runner.gguf_rows(hidden.reshape(-1, 64), w, 3, 0, True) for w in (q, k, v)]
        mixed = (rows[0] + rows[1].repeat(1, 4) * rows[2].repeat(1, 4)).relu()
        return torch.ops.runner.gguf_rows(mixed, o, 3, 0, True)

    hidden = torch.randn(1, 2, 64)
    before = cpu_linear.OwnProducts.grouped
    compiled = torch.compile(step, fullgraph=True, options={"post_grad_custom_post_pass": cpu_linear.OwnProducts()})
    with torch._inductor.config.patch(force_disable_caches=True):  # the pass runs (a cached graph would skip it)
        assert torch.equal(compiled(hidden), step(hidden))
    assert cpu_linear.OwnProducts.grouped == before + 1
