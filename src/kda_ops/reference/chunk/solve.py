"""Stage 3, the triangular solve and the WY factors (``docs/math.md``, "The chunkwise form")::

    Tm = (I + Mkk)^-1                 unit lower triangular
    W  = Tm diag(beta) Kt,   U = Tm diag(beta) v      (Kt = k exp(Gam))

The oracle of :mod:`kda_ops.triton.chunk.solve`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.reference.chunk.common import chunk_local_cumsum, gather, scatter, slot_index
from kda_ops.varlen import ChunkSlots


def solve_unit_lower(Mkk: Tensor) -> Tensor:
    """``(I + Mkk)^-1`` for strictly lower triangular ``Mkk [..., C, C]``."""
    C = Mkk.shape[-1]
    eye = torch.eye(C, dtype=Mkk.dtype, device=Mkk.device)
    inv: Tensor = torch.linalg.solve_triangular(eye + Mkk, eye.expand_as(Mkk), upper=False, unitriangular=True)
    return inv


def wy_factors(Tm: Tensor, k: Tensor, v: Tensor, beta: Tensor, Gam: Tensor) -> tuple[Tensor, Tensor]:
    """``W = Tm diag(beta) (k exp(Gam))`` and ``U = Tm diag(beta) v``."""
    b = beta.unsqueeze(-1)
    return Tm @ (b * k * Gam.exp()), Tm @ (b * v)


def solve(
    Mkk: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, slots: ChunkSlots, C: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(Tm, W, U)``: ``Tm = (I + Mkk)^-1 [T, HV, C]``, ``W = Tm diag(beta) k exp(Gam)``, ``U = Tm diag(beta) v``."""
    T = k.shape[0]
    index = slot_index(slots, C, T)
    Mc, kc, vc, gc, bc = (gather(x, index) for x in (Mkk, k, v, g, beta))
    Tm = solve_unit_lower(Mc)
    W, U = wy_factors(Tm, kc, vc, bc, chunk_local_cumsum(gc))
    return scatter(Tm, index, T), scatter(W, index, T), scatter(U, index, T)


__all__ = ["solve", "solve_unit_lower", "wy_factors"]
