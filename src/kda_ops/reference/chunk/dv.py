"""Backward stage 2, the gradients through the WY factors and the solve (``docs/math.md``, "The chunkwise form":
``E = U - W S``, ``W = Tm diag(beta) Kt``, ``U = Tm diag(beta) v``, ``Tm = (I + Mkk)^-1``)::

    dMqk = tril(dO E^T),   dW = -dE Hin^T,   X = Tm^T dE,   Y = Tm^T dW
    dv   = beta X,   dKt = beta Y,   dbeta = rowsum(X v) + rowsum(Y Kt)        (the part through U and W)
    dMkk = -tril(Tm^T dT Tm^T, -1),   dT = dE (beta v)^T + dW (beta Kt)^T

The oracle of :mod:`kda_ops.triton.chunk.dv`.
"""

from __future__ import annotations

from torch import Tensor

from kda_ops.reference.chunk.common import chunk_local_cumsum, expand_heads, gather, scatter, slot_index
from kda_ops.varlen import ChunkSlots


def dv(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, Tm: Tensor, Hin: Tensor, E: Tensor, dE: Tensor, dO: Tensor,
    slots: ChunkSlots, C: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dv, dbeta (the part through U and W), dMqk, dMkk, dKt, Gam)`` of :func:`kda_ops.triton.chunk.dv.chunk_bwd_dv`.

    ``k [T, H, K]`` as the launcher takes it, expanded to the value heads here."""
    T, HV = v.shape[:2]
    index = slot_index(slots, C, T)
    kc, vc, gc, bc, Tc, Ec, dEc, dOc = (gather(x, index) for x in (expand_heads(k, HV), v, g, beta, Tm, E, dE, dO))
    Gam = chunk_local_cumsum(gc)
    Kt = kc * Gam.exp()
    b = bc.unsqueeze(-1)
    TmT = Tc.transpose(-1, -2)
    dMqk = (dOc @ Ec.transpose(-1, -2)).tril()
    dW = -dEc @ Hin.transpose(-1, -2)
    X, Y = TmT @ dEc, TmT @ dW
    dbeta = (X * vc).sum(-1) + (Y * Kt).sum(-1)
    dT = dEc @ (b * vc).transpose(-1, -2) + dW @ (b * Kt).transpose(-1, -2)
    dMkk = -(TmT @ dT @ TmT).tril(-1)
    return (
        scatter(b * X, index, T),
        scatter(dbeta, index, T),
        scatter(dMqk, index, T),
        scatter(dMkk, index, T),
        scatter(b * Y, index, T),
        scatter(Gam, index, T),
    )


__all__ = ["dv"]
