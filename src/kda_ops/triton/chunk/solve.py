"""Stage 3: the solve ``Tm = (I + Mkk)^-1`` and the WY factors ``W = Tm diag(beta) Kt``, ``U = Tm diag(beta) V``.

``Mkk`` is strictly lower triangular, so ``I + Mkk`` is unit lower triangular and its inverse comes from block
substitution, the error hot spot of the chunk (``docs/math.md``, "Numerical traps"). It runs in the compute dtype
(fp32) with the solved block size doubled at each step: with ``T`` the inverse on blocks of ``B`` rows and ``C`` the
lower-left ``B x B`` part of each ``2B``-block, ``T - T C T`` is the inverse on blocks of ``2B`` rows. Six steps from
the identity (1 -> 64 rows), two tensor-core products each; the first four on the diagonal 16x16 blocks at once.
Each step computes entries of the inverse itself (no power series, no cancellation between large terms).

``W = Tm diag(beta) Kt`` comes from ``Kt_i = k_i exp(Gam_i)`` as the fused prepare kernel's key tiles stored it, in
``precision.store`` (``|Kt_i| <= |k_i|``): no second pass over ``k`` and ``g`` recomputing the decays. ``W`` and
``U`` are stored in ``precision.store``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda_ops.triton.chunk.tiles import BC, BT, col_mask, scale_rows, store2, tile2
from kda_ops.triton.lang import mm

# the doubling steps of the solve: within the 16-row blocks, then over the chunk
LOG2_BC = tl.constexpr(BC.bit_length() - 1)
LOG2_BT = tl.constexpr(BT.bit_length() - 1)


@triton.jit
def merge_halves(T, N, r, c, B: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """``(I + N)^-1`` on blocks of ``2B`` rows from ``T``, its inverse on blocks of ``B`` rows (``r, c``: the row and
    column indices, broadcast to ``T``'s shape): ``T - T C T``, ``C`` the lower-left ``B x B`` part of each
    ``2B``-block of ``N``. ``(I + N_B + C) = (I + N_B)(I + T C)`` and ``(T C)^2 = 0``."""
    C = tl.where((r // (2 * B) == c // (2 * B)) & (r // B > c // B), N, 0.0)
    return T - mm(T, mm(C, T, PREC, DT), PREC, DT)


@triton.jit
def solve_unit_lower(N2, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                     DT: tl.constexpr):
    """``(I + N)^-1 [BT, BT]`` for strictly lower triangular ``N [BT, BT]``.

    Block substitution with the solved block size doubled at each step (:func:`merge_halves`): from the identity,
    1 -> 2 -> 4 -> 8 -> 16 rows on the four diagonal blocks at once (batched ``[NB, BC, BC]`` products), then
    16 -> 32 -> 64 on the whole chunk. Two tensor-core products per step; no step reads a row at a time.
    """
    blk = tl.arange(0, NB)
    on_diag4 = blk[:, None, None, None] == blk[None, None, :, None]  # [I, 1, J, 1]
    Nd = tl.sum(tl.where(on_diag4, tl.reshape(N2, (NB, BC, NB, BC)), 0.0), axis=2)  # the diagonal blocks
    r3 = tl.arange(0, BC)[None, :, None]
    c3 = tl.arange(0, BC)[None, None, :]
    Td = tl.where(r3 == c3, 1.0, 0.0) + tl.zeros((NB, BC, BC), dtype=DT)
    # The diagonal blocks' steps run at the solve's precision (TF32 for bf16 inputs): 3xTF32 there changes no error
    # and costs the forward at B1 T32768 H32 bf16 on an H200 3.449 -> 3.582 ms.
    for lvl in tl.static_range(LOG2_BC):
        Td = merge_halves(Td, Nd, r3, c3, 1 << lvl, PREC, DT)
    T2 = tl.reshape(tl.where(on_diag4, Td[:, :, None, :], 0.0), (BT, BT))
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    for lvl in tl.static_range(LOG2_BC, LOG2_BT):
        T2 = merge_halves(T2, N2, rows, cols, 1 << lvl, PREC, DT)
    return T2


@triton.jit
def wy_stored(Tb, v, W, U, tok, m, i_hv, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              PREC: tl.constexpr, DT: tl.constexpr, nk, FOLD: tl.constexpr):
    """``W = Tb Kt`` and ``U = Tb V`` for ``Tb = Tm diag(beta) [BT, BT]``, where ``W`` holds ``Kt = k exp(Gam)`` of
    the chunk's rows on entry (stored in ``W``'s dtype by this program's key tiles in the fused prepare kernel; in
    the stage tests, by the standalone intra kernel of ``tests/triton/chunk/stage_kernels.py``): no second pass over
    ``k`` and ``g``. Each tile of ``W`` is read, then
    overwritten by the same program. ``FOLD``: the stored ``Kt`` rows are not yet l2-normalised; ``nk [BT]`` are
    their factors."""
    # Each tile is loaded one step ahead, before the store of the tile before it: a load after a store that it
    # might alias cannot be issued early, so each step would wait for its own load.
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    tl.debug_barrier()  # every thread's Kt stores before any thread's loads
    o_k = tl.arange(0, BK)
    Kt = tile2(W + i_hv * K, tok, m, HV * K, o_k, col_mask(o_k, K, BK))
    for i_k in range(NK - 1):
        o_n = (i_k + 1) * BK + tl.arange(0, BK)
        Kt_n = tile2(W + i_hv * K, tok, m, HV * K, o_n, col_mask(o_n, K, BK))
        tl.debug_barrier()  # every thread's loads of this tile before any thread's stores
        o_k = i_k * BK + tl.arange(0, BK)
        store2(W + i_hv * K, tok, m, HV * K, o_k, col_mask(o_k, K, BK), mm(Tb, scale_rows(Kt, nk, FOLD), PREC, DT))
        Kt = Kt_n
    # the last key tile: the first value tile loads before its store (the next step's load, as above)
    o_v = tl.arange(0, BV)
    vv = tile2(v + i_hv * V, tok, m, HV * V, o_v, col_mask(o_v, V, BV))
    tl.debug_barrier()
    o_k = (NK - 1) * BK + tl.arange(0, BK)
    store2(W + i_hv * K, tok, m, HV * K, o_k, col_mask(o_k, K, BK), mm(Tb, scale_rows(Kt, nk, FOLD), PREC, DT))
    for i_v in range(NV):
        o_n = (i_v + 1) * BV + tl.arange(0, BV)
        vv_n = tile2(v + i_hv * V, tok, m, HV * V, o_n, o_n < tl.where(i_v + 1 < NV, V, 0))
        o_v = i_v * BV + tl.arange(0, BV)
        store2(U + i_hv * V, tok, m, HV * V, o_v, col_mask(o_v, V, BV), mm(Tb, vv, PREC, DT))
        vv = vv_n


@triton.jit
def kb_stored(Tb, Kend, tok, m, i_hv, HV, K: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
              nk, FOLD: tl.constexpr):
    """``Kb = Tb^T diag(nk) Kend`` over ``Kend``'s tiles, in place: ``Kend`` holds the chunk's rows of
    ``k exp(Gam_last - Gam)`` on entry (stored by this program's key tiles; without their l2norm factors ``nk``
    when ``FOLD``). The scan's state update ``Kend^T E = Kend^T Tb X = Kb^T X`` then reads it (the "X form" of
    :func:`~kda_ops.triton.chunk.prepare.chunk_prepare`)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    TbT = tl.trans(Tb)
    tl.debug_barrier()  # every thread's Kend stores before any thread's loads
    o_k = tl.arange(0, BK)
    P = tile2(Kend + i_hv * K, tok, m, HV * K, o_k, col_mask(o_k, K, BK))
    for i_k in range(NK):
        # the next tile loads before this one's store (see wy_stored); the last step reloads the last tile
        o_n = tl.minimum(i_k + 1, NK - 1) * BK + tl.arange(0, BK)
        P_n = tile2(Kend + i_hv * K, tok, m, HV * K, o_n, col_mask(o_n, K, BK))
        tl.debug_barrier()  # every thread's loads of this tile before any thread's stores
        o_k = i_k * BK + tl.arange(0, BK)
        store2(Kend + i_hv * K, tok, m, HV * K, o_k, col_mask(o_k, K, BK), mm(TbT, scale_rows(P, nk, FOLD), PREC, DT))
        P = P_n


@triton.jit
def solve_wy(Mkk2, beta2, v, W, U, Tm, tok, m, i_hv, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
             BV: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, PREC_SOLVE: tl.constexpr,
             PREC_WY: tl.constexpr, DT: tl.constexpr, STORE_TM: tl.constexpr, nk, FOLD: tl.constexpr):
    """Stage 3 of one chunk from ``Mkk [BT, BT]`` (masked, beta applied) and ``beta [BT]``: ``Tm = (I + Mkk)^-1``
    (stored when ``STORE_TM``), then ``W`` and ``U`` (:func:`wy_stored`). The fused prepare kernels end with it in
    the backward's recompute (and the stage tests' standalone solve kernel)."""
    T2 = solve_unit_lower(Mkk2, NB, BC, BT, PREC_SOLVE, DT)
    if STORE_TM:
        cols = tl.arange(0, BT)
        store2(Tm + i_hv * BT, tok, m, HV * BT, cols, col_mask(cols, BT, BT), T2)
    wy_stored(T2 * beta2[None, :], v, W, U, tok, m, i_hv, HV, K, V, BK, BV, PREC_WY, DT, nk, FOLD)


__all__ = ["kb_stored", "merge_halves", "solve_unit_lower", "solve_wy", "wy_stored"]
