"""Oracles of the chunk pipeline's stages, one function per stage, in the layouts of the Triton stage launchers.

Every function takes the flat token stream (``[T, HV, ...]``: a dense batch ``[B, T]`` flattened, or packed
sequences) and the chunk-slot map of :func:`kda_ops.varlen.chunk_slots`, and returns what the matching Triton
launcher in ``kda_ops.triton.chunk_*`` returns: per-token rows (``Mqk``, ``Mkk``, ``Tm``: row ``t`` holds the
row of its chunk, ``C`` columns, zero past the chunk's tokens; ``Qt``, ``Kend``, ``W``, ``U``, ``E``) and
per-slot blocks (``Gam_last``, ``Hin``). Inputs are prepared (:func:`prepare_flat`): the in-kernel transforms
applied and q, k expanded to the value heads. The stage math is that of :mod:`kda_ops.reference.chunk`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.common import Options
from kda_ops.reference.chunk import (
    _gather,
    _scatter,
    chunk_local_cumsum,
    intra_chunk,
    slot_index,
    solve_unit_lower,
    state_scan,
    wy_factors,
)
from kda_ops.reference.gates import prepare
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
    """Flat ``[T, ...]`` inputs through the transforms, in ``dtype``: ``(q, k)`` per value head, ``g``, ``beta``."""
    HV = g.shape[1]
    qp, kp, gp, bp = prepare(q, k, g, beta, A_log, dt_bias, opts, dtype)
    G = HV // q.shape[1]
    return qp.repeat_interleave(G, dim=1), kp.repeat_interleave(G, dim=1), gp, bp


def chunk_cumsum(g: Tensor, slots: ChunkSlots, C: int) -> tuple[Tensor, Tensor]:
    """``Gam [T, HV, K]`` (chunk-local cumulative log decay) and ``Gam_last [NC, HV, K]`` from the log decay ``g``."""
    index = slot_index(slots, C, g.shape[0])
    Gam = chunk_local_cumsum(_gather(g, index))
    return _scatter(Gam, index, g.shape[0]), Gam[..., -1, :]


def chunk_intra(
    q: Tensor, k: Tensor, g: Tensor, beta: Tensor, scale: float, slots: ChunkSlots, C: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(Mqk, Mkk, Qt, Kend, Gam_last)``: ``Mqk, Mkk [T, HV, C]``, ``Qt = s q exp(Gam)``,
    ``Kend = k exp(Gam_last - Gam)`` ``[T, HV, K]``, ``Gam_last [NC, HV, K]``."""
    T = q.shape[0]
    index = slot_index(slots, C, T)
    qc, kc, gc, bc = (_gather(x, index) for x in (q, k, g, beta))
    Gam = chunk_local_cumsum(gc)
    Mqk, Mkk = intra_chunk(qc, kc, bc, Gam, scale)
    Gl = Gam[..., -1, :]
    Qt = scale * qc * Gam.exp()
    Kend = kc * (Gl.unsqueeze(-2) - Gam).exp()
    return _scatter(Mqk, index, T), _scatter(Mkk, index, T), _scatter(Qt, index, T), _scatter(Kend, index, T), Gl


def chunk_solve(
    Mkk: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, slots: ChunkSlots, C: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(Tm, W, U)``: ``Tm = (I + Mkk)^-1 [T, HV, C]``, ``W = Tm diag(beta) k exp(Gam)``, ``U = Tm diag(beta) v``."""
    T = k.shape[0]
    index = slot_index(slots, C, T)
    Mc, kc, vc, gc, bc = (_gather(x, index) for x in (Mkk, k, v, g, beta))
    Tm = solve_unit_lower(Mc)
    W, U = wy_factors(Tm, kc, vc, bc, chunk_local_cumsum(gc))
    return _scatter(Tm, index, T), _scatter(W, index, T), _scatter(U, index, T)


def chunk_state(
    W: Tensor, U: Tensor, Kend: Tensor, Gl: Tensor, h0: Tensor, slots: ChunkSlots, C: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(Hin [NC, HV, K, V], E [T, HV, V], final [N, HV, K, V])``: the scan ``E = U - W S``,
    ``S' = exp(Gam_last) S + Kend^T E`` over each sequence's slots, from ``h0``."""
    T = W.shape[0]
    index = slot_index(slots, C, T)
    Wc, Uc, Kc = (_gather(x, index) for x in (W, U, Kend))
    Hin, E, final = state_scan(Wc, Uc, Kc, Gl, h0, slots)
    return Hin, _scatter(E, index, T), final


def chunk_output(Qt: Tensor, Mqk: Tensor, Hin: Tensor, E: Tensor, slots: ChunkSlots, C: int) -> Tensor:
    """``o [T, HV, V] = Qt S + Mqk E`` per slot, ``S = Hin`` the state entering it."""
    T = Qt.shape[0]
    index = slot_index(slots, C, T)
    Qc, Mc, Ec = (_gather(x, index) for x in (Qt, Mqk, E))
    return _scatter(Qc @ Hin + Mc @ Ec, index, T)


def x_form(Mqk: Tensor, Kend: Tensor, Tm: Tensor, beta: Tensor, slots: ChunkSlots, C: int) -> tuple[Tensor, Tensor]:
    """The forward's X form of the factors (``chunk_prepare`` without ``store_tm``): ``(Mqk Tb [T, HV, C],
    Kb = Tb^T Kend [T, HV, K])`` per slot, ``Tb = Tm diag(beta)``. Since ``E = U - W S = Tb (V - Kt S)``, the scan
    of :func:`chunk_state` on ``(Kt, V, Kb)`` carries ``X = V - Kt S`` with ``E = Tb X``, and
    :func:`chunk_output` on ``(Qt, Mqk Tb, Hin, X)`` gives the same outputs."""
    T = Mqk.shape[0]
    index = slot_index(slots, C, T)
    Mc, Kc, Tc, bc = (_gather(x, index) for x in (Mqk, Kend, Tm, beta))
    Tb = Tc * bc.unsqueeze(-2)
    return _scatter(Mc @ Tb, index, T), _scatter(Tb.transpose(-1, -2) @ Kc, index, T)


__all__ = ["chunk_cumsum", "chunk_intra", "chunk_output", "chunk_solve", "chunk_state", "prepare_flat", "x_form"]
