"""The in-kernel input transforms of the chunk backward, in PyTorch (the l2norm in one Triton pass each way,
:mod:`kda_ops.triton.chunk.l2norm`): applied before the backward kernels, and their gradients chained after them
(``docs/math.md``, "Option gradients").

The backward kernels work on *prepared* tensors (the log decay g and the transformed beta in the compute dtype; q
and k as given, with the factors of their l2norm, which the kernels apply as they load them), so one set of kernels
serves every option. The l2norm's gradient runs here unless the dq/dk stage applied it (``norm_done``). These are
elementwise and row-wise torch ops on the device: no host synchronisation, shapes from the inputs only; the gate and
beta formulas are those of :mod:`kda_ops.transforms`, which the reference applies too. The floor of the log decay
(``kda_ops.common.LOG_DECAY_FLOOR``) is left to the kernels, which apply it as they load ``g``: no pass over ``g``
here; the gradient at a floored entry is then the kernels' at the floor (that of ``exp(-200)``: 0 up to rounding)
where the reference's is exactly 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.common import Options
from kda_ops.transforms import beta_transform, beta_transform_bwd, gate, gate_bwd
from kda_ops.triton.chunk.l2norm import l2norm_bwd, l2norm_factors


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
        g = gate(g, A_log, dt_bias, opts.lower_bound)
    return q, k, g, beta_transform(beta, opts.use_beta_sigmoid, opts.allow_neg_eigval), norms


def transform_inputs_bwd(
    q: Tensor, k: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, opts: Options,
    dq: Tensor, dk: Tensor, dg: Tensor, dbeta: Tensor, norm_done: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """Chain the gradients of the prepared tensors to the raw inputs (in dg's dtype; with l2norm, dq and dk come out
    of its gradient kernel in q's and k's own dtypes: no conversion pass afterwards). ``norm_done``: dq and dk are
    already the raw rows' gradients (the dq/dk stage applied the l2norm's).

    Returns ``(dq, dk, dg, dbeta, dA_log, ddt_bias)``; the last two are None unless the gate is in kernel.
    """
    dtype = dg.dtype  # the compute dtype (dq may come in q's own)
    if opts.use_qk_l2norm and not norm_done:
        dq, dk = l2norm_bwd(q, dq, q.dtype), l2norm_bwd(k, dk, k.dtype)
    dA: Tensor | None = None
    ddt: Tensor | None = None
    if opts.use_gate:
        dg, dA, ddt = gate_bwd(g.to(dtype), A_log, dt_bias, opts.lower_bound, dg)
    dbeta = beta_transform_bwd(beta.to(dtype), opts.use_beta_sigmoid, opts.allow_neg_eigval, dbeta)
    return dq, dk, dg, dbeta, dA, ddt


__all__ = ["transform_inputs", "transform_inputs_bwd"]
