"""The in-kernel input transforms (l2norm, gate, beta sigmoid) and their gradients, in plain PyTorch: the oracle
of :mod:`kda_ops.triton.chunk.inputs` and the transforms every reference schedule applies first.

Formulas (``docs/math.md``, "The recurrence"):

- l2norm: ``x / sqrt(sum(x * x) + 1e-6)`` over the last dimension.
- gate: ``g = -exp(A_log) * softplus(x + dt_bias)``; with ``lower_bound``:
  ``g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))``
  (``A_log`` may then be None: ``lower_bound * sigmoid(x + dt_bias)``).
- beta: ``sigmoid(beta)`` when asked, then times 2 with ``allow_neg_eigval``.

Every function works on ``[..., HV, K]`` (gate) or ``[..., HV]`` (beta) in the dtype it is given; callers upcast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kda_ops.common import L2NORM_EPS, Options


def l2norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x*x) + 1e-6)`` over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def l2norm_bwd(x: Tensor, dy: Tensor) -> Tensor:
    """Gradient of :func:`l2norm`: ``dx = r (dy - y (y . dy))``."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


def _gate_args(x: Tensor, A_log: Tensor | None, dt_bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``z0 = x + dt_bias`` with dt_bias ``[HV*K]`` viewed as ``[HV, K]``; and ``exp(A_log)`` as ``[HV, 1]``."""
    HV, K = x.shape[-2], x.shape[-1]
    z0 = x if dt_bias is None else x + dt_bias.to(x.dtype).view(HV, K)
    a = None if A_log is None else A_log.to(x.dtype).exp().view(HV, 1)
    return z0, a


def gate(x: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None) -> Tensor:
    """Log decay from the raw gate input ``x [..., HV, K]``."""
    z0, a = _gate_args(x, A_log, dt_bias)
    if lower_bound is None:
        assert a is not None, "the softplus gate needs A_log"
        return -a * F.softplus(z0)
    z = z0 if a is None else a * z0
    return lower_bound * torch.sigmoid(z)


def gate_bwd(
    x: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None, dg: Tensor
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of :func:`gate` to ``x``, ``A_log [HV]`` and ``dt_bias [HV*K]`` (None where not given)."""
    z0, a = _gate_args(x, A_log, dt_bias)
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


def transform_inputs(
    q: Tensor,
    k: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Apply every in-kernel transform in ``dtype``; returns (q, k, log decay g, beta) ready for the recurrence."""
    q, k, g, beta = q.to(dtype), k.to(dtype), g.to(dtype), beta.to(dtype)
    if opts.use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if opts.use_gate:
        g = gate(g, A_log, dt_bias, opts.lower_bound)
    return q, k, g, beta_transform(beta, opts.use_beta_sigmoid, opts.allow_neg_eigval)


def transform_inputs_bwd(
    q: Tensor,
    k: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    dq: Tensor,
    dk: Tensor,
    dg: Tensor,
    dbeta: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Chain the gradients of the prepared tensors back to the raw inputs (all in the dtype of ``dq``).

    Returns ``(dq, dk, dg, dbeta, dA_log, ddt_bias)``; the last two are None unless the gate is in kernel.
    """
    dtype = dq.dtype
    q, k, g, beta = q.to(dtype), k.to(dtype), g.to(dtype), beta.to(dtype)
    if opts.use_qk_l2norm:
        dq, dk = l2norm_bwd(q, dq), l2norm_bwd(k, dk)
    dA: Tensor | None = None
    ddt: Tensor | None = None
    if opts.use_gate:
        dg, dA, ddt = gate_bwd(g, A_log, dt_bias, opts.lower_bound, dg)
    dbeta = beta_transform_bwd(beta, opts.use_beta_sigmoid, opts.allow_neg_eigval, dbeta)
    return dq, dk, dg, dbeta, dA, ddt


__all__ = [
    "beta_transform",
    "beta_transform_bwd",
    "gate",
    "gate_bwd",
    "l2norm",
    "l2norm_bwd",
    "transform_inputs",
    "transform_inputs_bwd",
]
