"""The option transforms of the public contract in PyTorch, and their gradients (``docs/math.md``, "Option
gradients"): the reference applies them, and so does the chunk backward around its kernels (the kernels apply
the same formulas in kernel, :mod:`kda_ops.triton.lang`). Elementwise and row-wise torch ops: no host
synchronisation, shapes from the inputs only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kda_ops.common import L2NORM_EPS, LOG_DECAY_FLOOR


def l2norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x*x) + 1e-6)`` over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def l2norm_bwd(x: Tensor, dy: Tensor) -> Tensor:
    """Gradient of :func:`l2norm`: ``dx = r (dy - y (y . dy))``."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


def gate_args(x: Tensor, A_log: Tensor | None, dt_bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``z0 = x + dt_bias`` with dt_bias ``[HV*K]`` viewed as ``[HV, K]``; and ``exp(A_log)`` as ``[HV, 1]``."""
    HV, K = x.shape[-2], x.shape[-1]
    z0 = x if dt_bias is None else x + dt_bias.to(x.dtype).view(HV, K)
    a = None if A_log is None else A_log.to(x.dtype).exp().view(HV, 1)
    return z0, a


def gate(x: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None) -> Tensor:
    """Log decay from the raw gate input ``x [..., HV, K]``."""
    z0, a = gate_args(x, A_log, dt_bias)
    if lower_bound is None:
        assert a is not None, "the softplus gate needs A_log"
        return -a * F.softplus(z0)
    z = z0 if a is None else a * z0
    return lower_bound * torch.sigmoid(z)


def gate_bwd(
    x: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None, dg: Tensor
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of :func:`gate` to ``x``, ``A_log [HV]`` and ``dt_bias [HV*K]`` (None where not given)."""
    z0, a = gate_args(x, A_log, dt_bias)
    red = tuple(range(x.dim() - 2))
    dA: Tensor | None = None
    if lower_bound is None:
        assert a is not None
        dx = -a * torch.sigmoid(z0) * dg
        if A_log is not None:
            dA = (dg * (-a * F.softplus(z0))).sum(red).sum(-1)
    else:
        z = z0 if a is None else a * z0
        s = torch.sigmoid(z)
        dz = lower_bound * s * (1 - s) * dg
        dx = dz if a is None else a * dz
        if A_log is not None:
            dA = (dz * z).sum(red).sum(-1)
    ddt = None if dt_bias is None else dx.sum(red).reshape(-1)
    return dx, dA, ddt


def floor_log_decay(g: Tensor) -> Tensor:
    """The log decay the kernels use: ``max(g, LOG_DECAY_FLOOR)`` (``-inf``, a hard reset, to the floor)."""
    return g.clamp_min(LOG_DECAY_FLOOR)


def floor_log_decay_bwd(g: Tensor, dg: Tensor) -> Tensor:
    """Gradient of :func:`floor_log_decay` at ``g``: none where the floor replaced ``g``."""
    return torch.where(g >= LOG_DECAY_FLOOR, dg, torch.zeros_like(dg))


def beta_transform(beta: Tensor, use_sigmoid: bool, allow_neg_eigval: bool) -> Tensor:
    """``beta`` (or ``sigmoid(beta)``), times 2 with ``allow_neg_eigval``."""
    b = torch.sigmoid(beta) if use_sigmoid else beta
    return b * 2 if allow_neg_eigval else b


def beta_transform_bwd(beta: Tensor, use_sigmoid: bool, allow_neg_eigval: bool, db: Tensor) -> Tensor:
    """Gradient of :func:`beta_transform`."""
    c = 2.0 if allow_neg_eigval else 1.0
    if use_sigmoid:
        s = torch.sigmoid(beta)
        return c * s * (1 - s) * db
    return c * db


__all__ = [
    "beta_transform",
    "beta_transform_bwd",
    "floor_log_decay",
    "floor_log_decay_bwd",
    "gate",
    "gate_args",
    "gate_bwd",
    "l2norm",
    "l2norm_bwd",
]
