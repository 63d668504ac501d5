"""Stage 3: the solve ``Tm = (I + Mkk)^-1`` and the WY factors ``W = Tm diag(beta) Kt``, ``U = Tm diag(beta) V``.

``Mkk`` is strictly lower triangular, so ``I + Mkk`` is unit lower triangular and its inverse comes from block
substitution, the error hot spot of the chunk (``backward.md``). It runs in the compute dtype (fp32) with the
solved block size doubled at each step: with ``T`` the inverse on blocks of ``B`` rows and ``C`` the lower-left
``B x B`` part of each ``2B``-block, ``T - T C T`` is the inverse on blocks of ``2B`` rows. Six steps from the
identity (1 -> 64 rows), two tensor-core products each; the first four on the diagonal 16x16 blocks at once. Each
step computes entries of the inverse itself (no power series, no cancellation between large terms).

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
    # the small batched products of the diagonal blocks run at fp32 accuracy whatever PREC (3xTF32 at most)
    for lvl in tl.static_range(LOG2_BC):
        if PREC == "ieee":
            Td = merge_halves(Td, Nd, r3, c3, 1 << lvl, "ieee", DT)
        else:
            Td = merge_halves(Td, Nd, r3, c3, 1 << lvl, "tf32x3", DT)
    T2 = tl.reshape(tl.where(on_diag4, Td[:, :, None, :], 0.0), (BT, BT))
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    for lvl in tl.static_range(LOG2_BC, LOG2_BT):
        T2 = merge_halves(T2, N2, rows, cols, 1 << lvl, PREC, DT)
    return T2


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
def wy_stored(Tb, v, W, U, tok, m, i_hv, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              PREC: tl.constexpr, DT: tl.constexpr):
    """``W = Tb Kt`` and ``U = Tb V`` for ``Tb = Tm diag(beta) [BT, BT]``, where ``W`` holds ``Kt = k exp(Gam)`` of
    the chunk's rows on entry (stored by this program's key tiles, in ``W``'s dtype): no second pass over ``k`` and
    ``g``. Each tile of ``W`` is read, then overwritten by the same program."""
    tl.debug_barrier()  # every thread's Kt stores before any thread's loads
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = col_mask(o_k, K, BK)
        Kt = load2(W + i_hv * K, tok, m, HV * K, o_k, m_k, DT)
        tl.debug_barrier()  # every thread's loads of this tile before any thread's stores
        store2(W + i_hv * K, tok, m, HV * K, o_k, m_k, mm(Tb, Kt, PREC, DT))
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = col_mask(o_v, V, BV)
        vv = load2(v + i_hv * V, tok, m, HV * V, o_v, m_v, DT)
        store2(U + i_hv * V, tok, m, HV * V, o_v, m_v, mm(Tb, vv, PREC, DT))


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

__all__ = ["chunk_solve", "merge_halves", "solve_unit_lower", "wy_pass", "wy_stored"]
