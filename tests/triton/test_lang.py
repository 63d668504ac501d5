"""``kda_ops.triton.lang``: the shared ``@triton.jit`` helpers, checked value by value under the interpreter (on a
GPU the same kernels run compiled: ``tests/gpu`` covers them through the stages)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kda_ops.triton.lang import split_rows, stack_rows, tf32_nearest  # noqa: E402

pytestmark = pytest.mark.interpret


@triton.jit
def _round_kernel(x, y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, tf32_nearest(tl.load(x + i)))


def _rounded(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=torch.float32)
    _round_kernel[(1,)](x, y, N=x.numel())
    return y


def _nearest_tf32(x: np.ndarray) -> np.ndarray:
    """Round to the nearest value with 10 mantissa bits, ties away from zero, in float64 arithmetic."""
    m, e = np.frexp(x.astype(np.float64))  # x = m 2^e, 0.5 <= |m| < 1: 11 significant bits keep m to 2^-11
    r = np.sign(m) * np.floor(np.abs(m) * 2.0**11 + 0.5) / 2.0**11
    return np.ldexp(r, e).astype(np.float32)


def test_tf32_nearest_rounds_to_nearest_ties_away() -> None:
    one = 1.0
    ulp = 2.0**-10  # of TF32 at 1
    values = [0.0, -0.0, one, one + ulp / 2, one + ulp / 2 - 2.0**-23, one + ulp / 2 + 2.0**-23, -(one + ulp / 2),
              3.0 + 2.0**-12, 1e-30, -7.25e3 + 0.3, 2.0**-130, np.pi, -np.e, 65504.0, 1e30]  # fmt: skip
    rng = np.random.default_rng(0)
    x = np.concatenate([np.array(values, dtype=np.float32), rng.standard_normal(49).astype(np.float32) * 100])
    got = _rounded(torch.from_numpy(x)).numpy()
    want = _nearest_tf32(x)
    np.testing.assert_array_equal(got, want)
    assert got[3] == one + ulp and got[4] == one and got[6] == -(one + ulp)  # the tie away, below it, its mirror


def test_tf32_nearest_keeps_infinities_and_nans() -> None:
    """A NaN's payload plus the rounding's carry would overflow into the sign (0x7FFFFFFF to -0.0) or into an
    infinity (0x7F800001); infinities and NaNs pass unchanged, and the largest finite values round to infinity."""
    bits = np.array([0x7F800000, 0xFF800000, 0x7FFFFFFF, 0x7F800001, 0xFFFFFFFF, 0x7FC00000, 0x7F7FFFFF, 0],
                    dtype=np.uint32)  # fmt: skip
    got = _rounded(torch.from_numpy(bits.view(np.float32).copy())).numpy()
    assert got[0] == np.inf and got[1] == -np.inf
    assert np.isnan(got[2:6]).all()
    assert got[6] == np.inf


def test_tf32_nearest_widens_16_bit_values_exactly() -> None:
    x = torch.randn(64).half()
    assert torch.equal(_rounded(x), x.float())


@triton.jit
def _stack_kernel(a, b, s, h1, h2, R: tl.constexpr, C: tl.constexpr):
    p = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = stack_rows(tl.load(a + p), tl.load(b + p))
    tl.store(s + tl.arange(0, 2 * R)[:, None] * C + tl.arange(0, C)[None, :], x)
    lo, hi = split_rows(x * 2.0)
    tl.store(h1 + p, lo)
    tl.store(h2 + p, hi)


def test_stack_rows_and_split_rows_are_the_row_concatenation_and_its_halves() -> None:
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    s, h1, h2 = torch.empty(8, 8), torch.empty(4, 8), torch.empty(4, 8)
    _stack_kernel[(1,)](a, b, s, h1, h2, R=4, C=8)
    assert torch.equal(s, torch.cat((a, b)))
    assert torch.equal(h1, 2 * a) and torch.equal(h2, 2 * b)
