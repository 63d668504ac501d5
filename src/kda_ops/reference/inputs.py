"""The in-kernel input transforms (l2norm, gate, beta sigmoid) and their gradients, applied in plain PyTorch by
every reference schedule first (the formulas themselves live in :mod:`kda_ops.transforms`).

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
from torch import Tensor

from kda_ops.common import Options
from kda_ops.transforms import (
    beta_transform,
    beta_transform_bwd,
    floor_log_decay,
    floor_log_decay_bwd,
    gate,
    gate_bwd,
    l2norm,
    l2norm_bwd,
)


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
    return q, k, floor_log_decay(g), beta_transform(beta, opts.use_beta_sigmoid, opts.allow_neg_eigval)


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
        dg, dA, ddt = gate_bwd(
            g, A_log, dt_bias, opts.lower_bound, floor_log_decay_bwd(gate(g, A_log, dt_bias, opts.lower_bound), dg)
        )
    else:
        dg = floor_log_decay_bwd(g, dg)
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
