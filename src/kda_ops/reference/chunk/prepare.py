"""Stages 1-3 fused: the oracles of :mod:`kda_ops.triton.chunk.prepare` beyond those of the single stages.

:func:`prepare_flat` applies the in-kernel input transforms (:mod:`kda_ops.reference.inputs`) to the flat token
stream and expands q and k to the value heads: the inputs every stage oracle takes. :func:`x_form` gives the
factors the fused kernel stores for the forward, the *X form* of ``E = U - W S`` (``docs/math.md``, "The
chunkwise form"): with ``Tb = Tm diag(beta)``, ``E = Tb X`` for ``X = V - Kt S``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.common import Options
from kda_ops.reference.chunk.common import gather, scatter, slot_index
from kda_ops.reference.inputs import transform_inputs
from kda_ops.varlen import ChunkSlots


def prepare_flat(
    q: Tensor,
    k: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flat ``[T, ...]`` inputs (or ``[B, T, ...]``: any leading dimensions) through the transforms, in ``dtype``:
    ``(q, k)`` per value head, ``g``, ``beta``."""
    qp, kp, gp, bp = transform_inputs(q, k, g, beta, A_log, dt_bias, opts, dtype)
    G = g.shape[-2] // q.shape[-2]
    return qp.repeat_interleave(G, dim=-2), kp.repeat_interleave(G, dim=-2), gp, bp


def x_form(Mqk: Tensor, Kend: Tensor, Tm: Tensor, beta: Tensor, slots: ChunkSlots, C: int) -> tuple[Tensor, Tensor]:
    """The forward's X form of the factors (the fused prepare kernel without ``store_tm``): ``(Mqk Tb [T, HV, C],
    Kb = Tb^T Kend [T, HV, K])`` per slot, ``Tb = Tm diag(beta)``. Since ``E = U - W S = Tb (V - Kt S)``, the scan
    of :func:`kda_ops.reference.chunk.scan.scan` on ``(Kt, V, Kb)`` carries ``X = V - Kt S`` with ``E = Tb X``, and
    :func:`kda_ops.reference.chunk.output.output` on ``(Qt, Mqk Tb, Hin, X)`` gives the same outputs."""
    T = Mqk.shape[0]
    index = slot_index(slots, C, T)
    Mc, Kc, Tc, bc = (gather(x, index) for x in (Mqk, Kend, Tm, beta))
    Tb = Tc * bc.unsqueeze(-2)
    return scatter(Mc @ Tb, index, T), scatter(Tb.transpose(-1, -2) @ Kc, index, T)


__all__ = ["prepare_flat", "x_form"]
