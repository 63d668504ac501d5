"""``kda_ops.triton.chunk.l2norm``: the one-pass l2norm kernels of the chunk backward against the formula of
``kda_ops.transforms`` and autograd of it (float64), under the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.testing import assert_rel  # noqa: E402
from kda_ops.transforms import l2norm as l2norm_ref  # noqa: E402
from kda_ops.triton.chunk.l2norm import l2norm, l2norm_bwd, l2norm_factors  # noqa: E402
from tests.cases import F64  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_path")


@pytest.mark.parametrize("K", [64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_l2norm_and_its_gradient(K: int, dtype: torch.dtype, device: torch.device) -> None:
    """The one-pass l2norm kernels against the oracle's formula and autograd of it (float64), rows past a
    program's block and a zero row included."""
    x = torch.randn(3, 7, K, dtype=F64)
    x[1, 2] = 0.0
    dy = torch.randn(3, 7, K, dtype=F64)
    x, dy = x.to(device), dy.to(device)
    xd = x.to(dtype)
    y = l2norm(xd, torch.float32)
    dx = l2norm_bwd(xd, dy.float())
    xr = xd.to(F64).requires_grad_()
    yr = l2norm_ref(xr)
    (dxr,) = torch.autograd.grad(yr, xr, dy)
    assert y.dtype == torch.float32 and dx.dtype == torch.float32
    assert_rel(y, yr.detach(), 1e-6)
    assert_rel(dx, dxr, 1e-5)
    # the driver's form: the gradient stored in the input's own dtype, one rounding of the fp32 value
    dx_in = l2norm_bwd(xd, dy.float(), dtype)
    assert dx_in.dtype == dtype
    assert torch.equal(dx_in, dx.to(dtype))
    # the factors alone, as the backward's kernels take them: x r is the normalised row, bit for bit
    r = l2norm_factors(xd, torch.float32)
    assert r.shape == (3, 7) and r.dtype == torch.float32
    assert torch.equal(xd.float() * r[..., None], y)


def test_kernels_compile_for_sm90() -> None:
    """The l2norm kernels lower for sm_90 as the backward launches them (``tests/triton/sm90.py``)."""
    check_compiles("chunk.l2norm")
