"""Stage 3: the solve ``Tm = (I + Mkk)^-1`` and the WY factors ``W = Tm diag(beta) Kt``, ``U = Tm diag(beta) V``.

``Mkk`` is strictly lower triangular, so ``I + Mkk`` is unit lower triangular and its inverse comes from forward
substitution, the error hot spot of the chunk (``backward.md``): it runs in the compute dtype (fp32) over
16-row blocks. The four diagonal 16x16 blocks are inverted together, row by row; the blocks below the diagonal
follow block row by block row, ``Tm[I, :] = Tm_II (E_I - Mkk[I, <I] Tm[<I, :])``, two products per block row.

``Kt_i = k_i exp(Gam_i)`` never exceeds ``|k_i|``; ``W`` and ``U`` are stored in ``precision.store``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import Options
from kda_ops.triton.chunk_common import (
    BC,
    BT,
    NB,
    Precision,
    col_mask,
    compute_dtype,
    contiguous,
    launch,
    load2,
    load_beta2,
    mm,
    rnorm2,
    slot_rows,
    store2,
)
from kda_ops.triton.chunk_cumsum import gate_flags, load_log_decay
from kda_ops.triton.debug import poison
from kda_ops.triton.launch import Launcher
from kda_ops.varlen import SlotRows


@triton.jit
def solve_unit_lower(N2, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                     DT: tl.constexpr):
    """``(I + N)^-1 [BT, BT]`` for strictly lower triangular ``N [BT, BT]``."""
    N3 = tl.reshape(N2, (NB, BC, BT))  # row blocks
    blk = tl.arange(0, NB)
    r = tl.arange(0, BC)
    r3 = r[None, :, None]
    c3 = r[None, None, :]
    on_diag4 = blk[:, None, None, None] == blk[None, None, :, None]  # [I, 1, J, 1]
    # the diagonal blocks N[I, I]                                                   [NB, BC, BC]
    Nd = tl.sum(tl.where(on_diag4, tl.reshape(N3, (NB, BC, NB, BC)), 0.0), axis=2)
    # their inverses, all four at once: row i = e_i - sum_{c < i} N[i, c] Td[c, :]
    Td = tl.where(r3 == c3, 1.0, 0.0) + tl.zeros((NB, BC, BC), dtype=DT)
    for i in range(1, BC):
        n_i = tl.sum(tl.where(r3 == i, Nd, 0.0), axis=1)  # [NB, BC] row i of each block
        t_i = -tl.sum(n_i[:, :, None] * Td, axis=1)  # [NB, BC]
        Td = tl.where(r3 == i, t_i[:, None, :] + tl.where(c3 == i, 1.0, 0.0), Td)
    T3 = tl.reshape(tl.where(on_diag4, Td[:, :, None, :], 0.0), (NB, BC, BT))
    cols = tl.arange(0, BT)[None, :]
    for i_b in tl.static_range(1, NB):
        sel = blk[:, None, None] == i_b
        N_I = tl.where(cols < i_b * BC, tl.sum(tl.where(sel, N3, 0.0), axis=0), 0.0)  # [BC, BT]: N[I, <I]
        R = mm(N_I, tl.reshape(T3, (BT, BT)), PREC, DT)  # N[I, <I] Tm[<I, :]
        Td_I = tl.sum(tl.where(sel, Td, 0.0), axis=0)  # [BC, BC]
        T3 += tl.where(sel, -mm(Td_I, R, PREC, DT)[None, :, :], 0.0)
    return tl.reshape(T3, (BT, BT))


@triton.jit
def wy_pass(T2, k, v, g, beta, A_log, dt_bias, W, U, tok, m, i_h, i_hv, H, HV, lower_bound, rk,
            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
            USE_GATE: tl.constexpr, USE_A: tl.constexpr, USE_BIAS: tl.constexpr, USE_BOUND: tl.constexpr,
            BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Store ``W = Tm diag(beta) Kt`` and ``U = Tm diag(beta) V`` for ``Tm = T2 [BT, BT]`` (rows ``tok``).

    ``Kt = k exp(Gam)`` is recomputed from ``g`` (a prefix sum of one sign: no cancellation); ``rk`` is the
    l2norm factor of the rows of k (or 1.0).
    """
    beta2 = load_beta2(beta, tok, m, HV, i_hv, BETA_SIGMOID, NEG_EIGVAL, DT)[:, None]
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = col_mask(o_k, K, BK)
        kk = load2(k + i_h * K, tok, m, H * K, o_k, m_k, DT) * rk
        g2 = load_log_decay(g + i_hv * K, A_log, dt_bias, tok, m, HV * K, o_k, m_k, i_hv, lower_bound, K,
                            USE_GATE, USE_A, USE_BIAS, USE_BOUND, DT)  # fmt: skip
        bKt = beta2 * kk * tl.exp(tl.cumsum(g2, axis=0))
        store2(W + i_hv * K, tok, m, HV * K, o_k, m_k, mm(T2, bKt, PREC, DT))
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = col_mask(o_v, V, BV)
        bv = load2(v + i_hv * V, tok, m, HV * V, o_v, m_v, DT) * beta2
        store2(U + i_hv * V, tok, m, HV * V, o_v, m_v, mm(T2, bv, PREC, DT))


@triton.jit
def chunk_solve_kernel(
    Mkk, k, v, g, beta, A_log, dt_bias, Tm, W, U, slot_start, slot_count, lower_bound, H, HV,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr,
    BT: tl.constexpr, USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, USE_A: tl.constexpr,
    USE_BIAS: tl.constexpr, USE_BOUND: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    PREC_SOLVE: tl.constexpr, PREC_WY: tl.constexpr, DT: tl.constexpr, STORE_TM: tl.constexpr,
):  # fmt: skip
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count == 0:
        return
    cols = tl.arange(0, BT)
    m_c = col_mask(cols, BT, BT)
    T2 = solve_unit_lower(load2(Mkk + i_hv * BT, tok, m, HV * BT, cols, m_c, DT), NB, BC, BT, PREC_SOLVE, DT)
    if STORE_TM:
        store2(Tm + i_hv * BT, tok, m, HV * BT, cols, m_c, T2)
    if USE_L2NORM:
        rk = rnorm2(k + i_h * K, tok, m, H * K, K, BK, BT, DT)
    else:
        rk = 1.0
    wy_pass(T2, k, v, g, beta, A_log, dt_bias, W, U, tok, m, i_h, i_hv, H, HV, lower_bound, rk, K, V, BK, BV, BT,
            USE_GATE, USE_A, USE_BIAS, USE_BOUND, BETA_SIGMOID, NEG_EIGVAL, PREC_WY, DT)  # fmt: skip


def chunk_solve(
    Mkk: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    slots: SlotRows,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    precision: Precision,
    store_tm: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(Tm, W, U)`` of every chunk slot: ``Tm [T, HV, BT]`` in the compute dtype, ``W [T, HV, K]`` and
    ``U [T, HV, V]`` in ``precision.store``. ``Mkk [T, HV, BT]`` as from
    :func:`~kda_ops.triton.chunk_intra.chunk_intra`; ``k [T, H, K]``, ``v [T, HV, V]``, ``g [T, HV, K]``,
    ``beta [T, HV]`` as given to the public function. ``store_tm=False`` (the forward) leaves ``Tm`` unwritten
    (and unallocated: an empty tensor); only the backward reads it."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    NC = slots.start.shape[0]
    Tm = torch.empty_like(Mkk) if store_tm else Mkk.new_empty(0)
    W = k.new_empty(T, HV, K, dtype=precision.store)
    U = v.new_empty(T, HV, V, dtype=precision.store)
    poison(Tm, W, U)
    _launch_solve(
        (NC, HV),
        (contiguous(Mkk), contiguous(k), contiguous(v), contiguous(g), contiguous(beta), A_log, dt_bias, Tm, W, U,
         slots.start, slots.count, 0.0 if opts.lower_bound is None else float(opts.lower_bound), H, HV),
        dict(K=K, V=V, NB=NB, BC=BC, BT=BT, USE_L2NORM=opts.use_qk_l2norm,
             BETA_SIGMOID=opts.use_beta_sigmoid, NEG_EIGVAL=opts.allow_neg_eigval, PREC_SOLVE=precision.solve,
             PREC_WY=precision.wy, DT=compute_dtype(k), STORE_TM=store_tm, **gate_flags(opts, A_log, dt_bias),
             **launch("solve", BK=K, BV=V)),
    )  # fmt: skip
    return Tm, W, U


_launch_solve = Launcher(chunk_solve_kernel)

__all__ = ["chunk_solve", "solve_unit_lower", "wy_pass"]
