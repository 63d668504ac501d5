"""The in-kernel input transforms of the chunk backward, in PyTorch (the l2norm in one Triton pass each way,
:mod:`kda_ops.triton.chunk.l2norm`): applied before the backward kernels, and their gradients chained after them
(``docs/math.md``, "Option gradients").

The backward kernels work on *prepared* tensors (the log decay g and the transformed beta in the compute dtype; q
and k as given, with the factors of their l2norm, which the kernels apply as they load them), so one set of kernels
serves every option. These are elementwise and row-wise torch ops on
the device: no host synchronisation, shapes from the inputs only. (``kda_ops.reference.inputs`` holds the same
math for the oracle; ``kda_ops.triton`` never imports the reference, so it is written out here.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kda_ops.common import Options
from kda_ops.triton.chunk.l2norm import l2norm_bwd, l2norm_factors


def _gate_args(x: Tensor, A_log: Tensor | None, dt_bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``z0 = x + dt_bias`` (dt_bias ``[HV*K]`` as ``[HV, K]``) and ``exp(A_log)`` as ``[HV, 1]``."""
    HV, K = x.shape[-2], x.shape[-1]
    z0 = x if dt_bias is None else x + dt_bias.to(x.dtype).view(HV, K)
    a = None if A_log is None else A_log.to(x.dtype).exp().view(HV, 1)
    return z0, a


def transform_inputs(
    q: Tensor, k: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, opts: Options,
    dtype: torch.dtype, with_norms: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """``(q, k, g, beta, norms)`` after the options (any leading shape; q, k ``[..., H, K]``): ``g`` and ``beta`` in
    ``dtype``, ``q`` and ``k`` as given (the kernels convert them as they load them). With the l2norm, ``norms [2,
    ..., H]`` in ``dtype`` holds the factors of q's rows and of k's (``l2norm_factors``: ``q * norms[0]`` is the
    l2-normalised q exactly), else None; None too without ``with_norms`` (the training forward saved them).

    The factors replace a normalised copy of q and k in the compute dtype (one pass writing ``[T, H, K]`` fp32 each,
    read again by the recompute, the dv and the dq/dk stages): the kernels form ``x r`` as they load ``x``."""
    norms = None
    if opts.use_qk_l2norm and with_norms:
        norms = torch.stack((l2norm_factors(q, dtype), l2norm_factors(k, dtype)))
    g, beta = g.to(dtype), beta.to(dtype)
    if opts.use_gate:
        z0, a = _gate_args(g, A_log, dt_bias)
        if opts.lower_bound is None:
            assert a is not None, "the softplus gate needs A_log"
            g = -a * F.softplus(z0)
        else:
            g = opts.lower_bound * torch.sigmoid(z0 if a is None else a * z0)
    if opts.use_beta_sigmoid:
        beta = torch.sigmoid(beta)
    if opts.allow_neg_eigval:
        beta = beta * 2
    return q, k, g, beta, norms


def transform_inputs_bwd(
    q: Tensor, k: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, opts: Options,
    dq: Tensor, dk: Tensor, dg: Tensor, dbeta: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """Chain the gradients of the prepared tensors to the raw inputs (in dq's dtype; with l2norm, dq and dk come out
    of its gradient kernel in q's and k's own dtypes: no conversion pass afterwards).

    Returns ``(dq, dk, dg, dbeta, dA_log, ddt_bias)``; the last two are None unless the gate is in kernel.
    """
    dtype = dq.dtype
    if opts.use_qk_l2norm:
        dq, dk = l2norm_bwd(q, dq, q.dtype), l2norm_bwd(k, dk, k.dtype)
    dA: Tensor | None = None
    ddt: Tensor | None = None
    if opts.use_gate:
        x = g.to(dtype)
        z0, a = _gate_args(x, A_log, dt_bias)
        red = tuple(range(x.dim() - 2))
        if opts.lower_bound is None:
            assert a is not None
            dx = -a * torch.sigmoid(z0) * dg
            if A_log is not None:
                dA = (dg * (-a * F.softplus(z0))).sum(red).sum(-1)
        else:
            z = z0 if a is None else a * z0
            s = torch.sigmoid(z)
            dz = opts.lower_bound * s * (1 - s) * dg
            dx = dz if a is None else a * dz
            if A_log is not None:
                dA = (dz * z).sum(red).sum(-1)
        ddt = None if dt_bias is None else dx.sum(red).reshape(-1)
        dg = dx
    c = 2.0 if opts.allow_neg_eigval else 1.0
    if opts.use_beta_sigmoid:
        s = torch.sigmoid(beta.to(dtype))
        dbeta = c * s * (1 - s) * dbeta
    elif opts.allow_neg_eigval:
        dbeta = c * dbeta
    return dq, dk, dg, dbeta, dA, ddt


__all__ = ["transform_inputs", "transform_inputs_bwd"]
