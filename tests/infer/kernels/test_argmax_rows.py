"""runner::argmax_rows and decode.sampling.greedy_tokens: exactly torch's argmax (the first maximum; a NaN's row gives
the first NaN) on random rows of many widths, ties, -inf, signed zeros, NaN and non-contiguous logits."""

import pytest
import torch

from runner.infer.decode.sampling import greedy_tokens
from runner.infer.kernels import native

pytestmark = pytest.mark.skipif(not native.load(), reason="runner's C++ kernels are not built here (no compiler)")


def _argmax(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.runner.argmax_rows(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 3, 15, 16, 17, 255, 49152, 151936])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_random_rows_give_torchs_argmax(width, rows, dtype):
    """In 16-bit floats wide rows hold tied maxima (bfloat16 has 8 bits of mantissa): the first must win."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width + rows)).to(dtype)
    assert torch.equal(_argmax(x), x.argmax(-1))


def test_ties_give_the_first_maximum_wherever_it_is():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 1000), generator=g).float()  # values 0..3: every row has many maxima
    x[5, :] = 2.0  # all equal
    x[6, 999] = 9.0  # the last column alone
    x[7, 0] = 9.0  # the first alone
    assert torch.equal(_argmax(x), x.argmax(-1))


def test_infinities_signed_zeros_and_nan_give_torchs_answer():
    x = torch.full((6, 40), -float("inf"))
    x[1, 17] = float("inf")
    x[2] = 0.0
    x[2, :10] = -0.0  # -0.0 == 0.0: the first of them
    x[3, 33] = float("nan")  # torch's argmax: the NaN
    x[4, 2], x[4, 30] = float("nan"), 5.0
    x[5, 39] = -1e30
    assert torch.equal(_argmax(x), x.argmax(-1))
    assert _argmax(x)[3] == 33 and _argmax(x)[4] == 2


def test_non_contiguous_and_sliced_logits():
    base = torch.randn(8, 3, 500, generator=torch.Generator().manual_seed(1))
    for x in (base[:, 1], base[:, 1, 7:400], base.transpose(0, 1)[2], base[:, 2].t().t()[::2],
              base.to(torch.bfloat16)[:, 1, 7:400]):
        assert not x.is_contiguous()
        assert torch.equal(_argmax(x), x.argmax(-1))


def test_greedy_tokens_equals_argmax_on_every_dtype_and_shape():
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))
    for logits in (x, x.to(torch.bfloat16), x.double(), x[0]):
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


def test_greedy_tokens_keeps_the_first_of_tied_maxima_in_half_precision():
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.zeros(4, 300, dtype=dtype)
        x[0, [7, 150, 299]] = 3.0  # tied: the first wins
        x[1, [0, 1]] = 1.0
        x[2, 200] = float("nan")  # a NaN is the maximum, as in torch
        x[3, 5], x[3, 6] = 1.0, 1.0 + torch.finfo(dtype).eps  # one step apart: the larger
        assert greedy_tokens(x).tolist() == [7, 0, 200, 6]
        assert torch.equal(greedy_tokens(x), x.argmax(-1))


def test_bad_logits_are_refused():
    with pytest.raises(RuntimeError, match="float32"):
        _argmax(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="V ≥ 1"):
        _argmax(torch.zeros(2, 0))
