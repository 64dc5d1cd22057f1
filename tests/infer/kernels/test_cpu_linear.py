"""runner::linear_rows (cpu_linear): few-row products against float64 within their dtype's rounding, its errors, and
OwnProducts, the pass that rewrites aten's few-row products on row-major weights into it (and nothing else)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from runner.infer.kernels import cpu_linear
from tests.machine import missing

pytestmark = pytest.mark.skipif(  # the product is served only by its vectorized paths (cpu_linear.load)
    not cpu_linear.load(), reason=f"{missing('avx2', 'fma') or 'no C++ compiler'}: products stay aten's")

SHAPES = [(7, 5), (19, 37), (33, 64), (192, 576), (576, 1536)]  # (N, K): tails of 8 rows and of 16 columns


# The kernel is built for this CPU (-march=native): each path runs where the CPU has its instructions, and a path
# it lacks is skipped saying so. `widest` takes vdpbf16ps for bfloat16 with AVX-512 BF16 (AMX tiles where the CPU
# has them and K and N are multiples of 32: the last two SHAPES) and 64-byte loads for float32 with AVX-512F, else
# falls back to AVX2. Past 8 rows the paths without AMX take 8 rows at a time.
DPBF16, AVX512 = missing("avx512f", "avx512_bf16"), missing("avx512f")
PATHS = [pytest.param(torch.float32, False, id="float32-avx2"),
         pytest.param(torch.float32, True, id="float32-avx512",
                      marks=pytest.mark.skipif(bool(AVX512), reason=f"{AVX512}: the 64-byte path is not built")),
         pytest.param(torch.float32, True, id="float32-widest-falls-back-to-avx2",
                      marks=pytest.mark.skipif(not AVX512, reason="this CPU has AVX-512: widest takes 64-byte loads "
                                                                  "(tested as float32-avx512)")),
         pytest.param(torch.bfloat16, False, id="bfloat16-avx2"),
         pytest.param(torch.bfloat16, True, id="bfloat16-avx512_bf16",
                      marks=pytest.mark.skipif(bool(DPBF16), reason=f"{DPBF16}: the vdpbf16ps path is not built")),
         pytest.param(torch.bfloat16, True, id="bfloat16-widest-falls-back-to-avx2",
                      marks=pytest.mark.skipif(not DPBF16, reason="this CPU has AVX-512 BF16: widest takes vdpbf16ps "
                                                                  "(tested as bfloat16-avx512_bf16)"))]


@pytest.mark.parametrize("dtype, widest", PATHS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])
def test_few_rows_match_float64_within_the_dtypes_rounding(dtype, widest, rows):
    """float32: float32 sums of K products, |error| ≤ 1e-5·Σ|x·w|; bfloat16: those sums rounded to bfloat16 once,
    |error| ≤ 2⁻⁸·|y| (half an ulp is 2⁻⁹) + 1e-5·Σ|x·w|. bfloat16 both ways: `widest` (vdpbf16ps where the CPU has
    AVX-512 BF16) and the AVX2 path every x86-64 CPU with AVX2 takes."""
    generator = torch.Generator().manual_seed(rows)
    for n, k in SHAPES:
        x, w, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((rows, k), (n, k), (n,)))
        for b in (None, bias):
            got = torch.ops.runner.linear_rows(x, w.t(), b, widest)
            want = x.double() @ w.double().t() + (0 if b is None else b.double())
            magnitude = x.double().abs() @ w.double().abs().t()
            bound = 1e-5 * magnitude + (2**-8 * want.abs() if dtype == torch.bfloat16 else 0)
            assert got.dtype == dtype and got.shape == (rows, n)
            assert ((got.double() - want).abs() <= bound).all(), (n, k, b is None)


@pytest.mark.parametrize("dtype, widest", PATHS)
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("outer", [(576, 64, 64), (1536, 19)], ids=["whole-tiles", "a-tail"])
def test_a_group_of_products_gives_what_each_product_gives_alone(dtype, widest, rows, outer):
    """linear_rows_group (q, k, v or gate, up of the native step: one parallel region where the AMX path takes every
    shape, as whole-tiles' on a CPU with AMX; one call a product elsewhere, as a-tail's) returns each product exactly
    as linear_rows does: the same kernel, the same sums."""
    generator = torch.Generator().manual_seed(rows)
    k = 576
    x = torch.randn(rows, k, generator=generator).to(dtype)
    weights = [torch.randn(n, k, generator=generator).to(dtype) for n in outer]
    biases = [torch.randn(n, generator=generator).to(dtype) if i % 2 == 0 else None for i, n in enumerate(outer)]
    got = torch.ops.runner.linear_rows_group(x, [w.t() for w in weights], biases, widest)
    assert len(got) == len(weights)
    for y, w, b in zip(got, weights, biases):
        assert torch.equal(y, torch.ops.runner.linear_rows(x, w.t(), b, widest))


def test_a_group_needs_one_bias_a_weight():
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="linear_rows_group: one bias"):
        torch.ops.runner.linear_rows_group(x, [w.t(), w.t()], [None])


@pytest.mark.parametrize("case", ["seventeen rows", "input-major weight", "dtypes differ", "float16"])
def test_what_it_does_not_serve_is_an_error_saying_so(case):
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    wt = {"input-major weight": w.t().contiguous()}.get(case, w.t())
    x = {"seventeen rows": torch.randn(17, 64), "dtypes differ": x.bfloat16(), "float16": x.half()}.get(case, x)
    if case == "float16":
        wt = wt.half()
    with pytest.raises(RuntimeError, match="linear_rows: .*(rows|row-major|dtype|float32 or bfloat16)"):
        torch.ops.runner.linear_rows(x, wt, None)


def _rewritten(fn, *args) -> tuple[torch.fx.GraphModule, int]:
    """fn traced to aten (fake tensors: each node's meta holds shapes and strides), then OwnProducts → (graph,
    products rewritten)."""
    module = make_fx(fn, tracing_mode="fake")(*args)
    before = cpu_linear.OwnProducts.replaced
    cpu_linear.OwnProducts()(module.graph)
    module.recompile()
    return module, cpu_linear.OwnProducts.replaced - before


def _targets(module: torch.fx.GraphModule) -> list:
    return [node.target for node in module.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pass_rewrites_few_row_products_on_stored_weights(dtype):
    """Two Linears as a model has them (one with a bias, inputs [B,T,K]): both rewritten at B·T ≤ 8, the result
    aten's within rounding."""
    def two_linears(x, w1, b1, w2):
        return torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1).relu(), w2)

    generator = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=generator).to(dtype) for s in ((2, 1, 48), (40, 48), (40,), (24, 40))]
    module, replaced = _rewritten(two_linears, *args)
    assert replaced == 2 and _targets(module).count(torch.ops.runner.linear_rows.default) == 2
    assert torch.ops.aten.mm.default not in _targets(module) and torch.ops.aten.addmm.default not in _targets(module)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(module(*args), two_linears(*args), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", ["sixteen rows", "bfloat16, eight rows", "input-major weight", "float16"])
def test_the_pass_leaves_what_the_kernel_does_not_serve_to_aten(case):
    """Past MAX_ROWS (float32 16 rows; bfloat16 8 where the AMX path does not take them: K = 48 is not a multiple of
    32; where aten's product was as fast), other layouts and dtypes."""
    x = torch.randn({"sixteen rows": 16, "bfloat16, eight rows": 8}.get(case, 1), 48)
    w = torch.randn(40, 48)
    if case == "bfloat16, eight rows":
        x, w = x.bfloat16(), w.bfloat16()
    if case == "input-major weight":
        w = w.t().contiguous().t()  # same values, transposed storage (what input_major_weights makes)
    if case == "float16":
        x, w = x.half(), w.half()
    module, replaced = _rewritten(lambda x, w: torch.nn.functional.linear(x, w), x, w)
    assert replaced == 0 and torch.ops.aten.mm.default in _targets(module)


@pytest.mark.parametrize("outer, inner", [(64, 96), (40, 96), (64, 48)])
def test_sixteen_bfloat16_rows_go_to_the_kernel_where_its_amx_path_runs_them(outer, inner):
    """bfloat16 past MAX_ROWS: rewritten where the AMX tiles multiply all 16 rows in one pass over the weights (K
    and N multiples of 32, the CPU's tiles granted), left to aten elsewhere (this CPU's answer, asked of the
    kernel, never assumed); the result aten's within bfloat16 rounding either way."""
    generator = torch.Generator().manual_seed(outer + inner)
    x, w = (torch.randn(*shape, generator=generator).bfloat16() for shape in ((16, inner), (outer, inner)))
    amx = torch.ops.runner.linear_rows_amx(64, 64) and outer % 32 == 0 and inner % 32 == 0  # tiles granted here
    assert cpu_linear.rows_served(torch.bfloat16, inner, outer) == (16 if amx else cpu_linear.MAX_ROWS[torch.bfloat16])
    module, replaced = _rewritten(lambda x, w: torch.nn.functional.linear(x, w), x, w)
    assert replaced == int(amx) and (torch.ops.aten.mm.default in _targets(module)) != amx
    torch.testing.assert_close(module(x, w), torch.nn.functional.linear(x, w), rtol=2e-2, atol=2e-2)
