"""Row l2 normalisation of q and k for the chunk backward, and its gradient, in one pass each.

The chain rule of the normalisation runs after the backward kernels (:mod:`~kda_ops.triton.chunk.inputs`) where the
dq/dk stage does not apply it itself (:func:`~kda_ops.triton.chunk.dqk.norm_in_epilogue`). In torch
ops the normalisation and its gradient are each a handful of full passes over ``[T, H, K]`` fp32 tensors (0.5 GB
apiece at T = 32k, H = 32, K = 128); these kernels read and write each tensor once:

    y = x r,  r = 1 / sqrt(sum_d x_d^2 + eps)                       (forward, ``reference/inputs.py``)
    dx = r (dy - y sum_d(y_d dy_d))                                 (its gradient)

The chunk backward's kernels take ``r`` alone (:func:`l2norm_factors`, ``[rows]``) and form ``x r`` as they load
``x``: the same fp32 product as ``y`` here, without writing ``y``.

One program per block of ``BR`` rows; the whole key dimension (``BK = pow2(K)``) is one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.triton.lang import l2norm_bwd as l2norm_bwd_rows
from kda_ops.triton.lang import rnorm
from kda_ops.triton.launch import cdiv, compute_dtype, contiguous, pow2

ROWS = 16  # rows per program


@triton.jit
def _l2norm_kernel(x, dy, out, R, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BACKWARD: tl.constexpr,
                   FACTORS: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    m = (rows < R)[:, None] & (cols < K)[None, :]
    p = rows[:, None] * K + cols[None, :]
    xv = tl.load(x + p, mask=m, other=0.0).to(DT)
    r = rnorm(tl.sum(xv * xv, axis=1))  # [BR]
    if FACTORS:
        tl.store(out + rows, r.to(out.dtype.element_ty), mask=rows < R)
        return
    y = xv * r[:, None]
    if BACKWARD:
        g = tl.load(dy + p, mask=m, other=0.0).to(DT)
        y = l2norm_bwd_rows(y, r[:, None], g, 1)
    tl.store(out + p, y.to(out.dtype.element_ty), mask=m)


def _launch(x: Tensor, dy: Tensor | None, dtype: torch.dtype, factors: bool = False) -> Tensor:
    x = contiguous(x)
    K = x.shape[-1]
    out = torch.empty(x.shape[:-1] if factors else x.shape, dtype=dtype, device=x.device)
    R = x.numel() // K if K else 0
    if R == 0:
        return out
    _l2norm_kernel[(cdiv(R, ROWS),)](
        x, x if dy is None else contiguous(dy), out, R, K=K, BK=pow2(K), BR=ROWS, BACKWARD=dy is not None,
        FACTORS=factors, DT=compute_dtype(out if dy is None else dy), num_warps=4,
    )  # fmt: skip
    return out


def l2norm(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x / sqrt(sum(x * x, -1) + eps)`` in ``dtype`` (computed in fp32, or fp64 for an fp64 ``dtype``)."""
    return _launch(x, None, dtype)


def l2norm_factors(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``1 / sqrt(sum(x * x, -1) + eps)``, shaped ``x.shape[:-1]``, in ``dtype`` (computed as :func:`l2norm`
    computes its factor, so ``x * r`` equals :func:`l2norm`'s result exactly)."""
    return _launch(x, None, dtype, factors=True)


def l2norm_bwd(x: Tensor, dy: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The gradient of :func:`l2norm` at ``x`` for the output gradient ``dy``, in ``dtype`` (default ``dy``'s),
    computed in ``dy``'s compute dtype (fp32, fp64 for fp64)."""
    return _launch(x, dy, dy.dtype if dtype is None else dtype)


__all__ = ["l2norm", "l2norm_bwd", "l2norm_factors"]
