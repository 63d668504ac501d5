"""Standalone kernels of single chunk stages, for the stage tests only: the package runs these stages fused
(:mod:`kda_ops.triton.chunk.prepare`), and the tests check each stage alone against its oracle through these."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import Options, forward_outputs, state_dtype
from kda_ops.triton.chunk.decays import chunk_decays, gate_bound, gate_flags, load_log_decay
from kda_ops.triton.chunk.forward import _opt, final_without_tokens
from kda_ops.triton.chunk.intra import intra_anchored, intra_blocks, intra_masks, key_tile, qk_norms, row_span
from kda_ops.triton.chunk.output import chunk_output
from kda_ops.triton.chunk.precision import Precision, precision_for
from kda_ops.triton.chunk.scan import chunk_state
from kda_ops.triton.chunk.slots import slot_map
from kda_ops.triton.chunk.solve import solve_wy
from kda_ops.triton.chunk.tiles import (
    ANCHOR_SPAN,
    BC,
    BT,
    FACTOR_SPAN,
    NB,
    col_mask,
    load2,
    load_beta2,
    slot_rows,
    store2,
)
from kda_ops.triton.launch import Launcher, cdiv, compute_dtype, contiguous, flat, launch, poison, pow2
from kda_ops.varlen import SlotRows

# launch configurations of these kernels
LAUNCH = {
    "cumsum": {"num_warps": 4, "num_stages": 1},
    "intra": {"num_warps": 4, "num_stages": 1, "BK": 32},
    "solve": {"num_warps": 4, "num_stages": 1, "BK": 64, "BV": 64},
}


@triton.jit
def chunk_intra_kernel(
    q, k, g, beta, A_log, dt_bias, Mqk, Mkk, Qt, Kend, Kt, Gl, flag, slot_start, slot_count, scale, lower_bound, H,
    HV,
    K: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    PREC: tl.constexpr, DT: tl.constexpr, ASPAN: tl.constexpr, SPAN: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    """Two passes over the chunk slots. ``BLOCKS = False``: the anchored path; a chunk with a key tile beyond
    ``ASPAN`` is left to the second pass (``flag = 1``, Mqk/Mkk not written). ``BLOCKS = True``: the block path
    for the flagged chunks only. Two kernels rather than a branch per tile: the block path's registers would
    otherwise bound the occupancy of the common case."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count == 0:
        return
    p_flag = flag + i_c.to(tl.int64) * HV + i_hv
    if BLOCKS:
        if tl.load(p_flag) == 0:
            return
    rq, rk = qk_norms(q, k, tok, m, i_h, H, K, BK, BT, USE_L2NORM, DT)
    Mqk2 = tl.zeros((BT, BT), dtype=DT)
    Mkk2 = tl.zeros((BT, BT), dtype=DT)
    span = tl.zeros((BT,), dtype=DT)
    for i_k in range(tl.cdiv(K, BK)):
        qs, kk, g2, E = key_tile(
            q,
            k,
            g,
            A_log,
            dt_bias,
            Qt,
            Kend,
            Gl,
            Kt,
            tok,
            m,
            i_c,
            i_h,
            i_hv,
            H,
            HV,
            scale,
            lower_bound,
            rq,
            rk,
            i_k,
            K,
            BK,
            BT,
            USE_GATE,
            HAS_A_LOG,
            HAS_DT_BIAS,
            USE_LOWER_BOUND,
            DT,
            not BLOCKS,
        )
        if BLOCKS:
            Mqk2, Mkk2 = intra_blocks(qs, kk, g2, Mqk2, Mkk2, NB, BC, BT, BK, PREC, DT, SPAN)
        else:
            span = row_span(span, E)
            Mqk2, Mkk2 = intra_anchored(qs, kk, E, Mqk2, Mkk2, PREC, DT, ASPAN)
    ok = tl.max(span, axis=0) <= ASPAN
    if not BLOCKS:
        tl.store(p_flag, tl.where(ok, 0, 1).to(flag.dtype.element_ty))
    if BLOCKS or ok:
        beta2 = load_beta2(beta, tok, m, HV, i_hv, USE_BETA_SIGMOID, NEG_EIGVAL, DT)
        Mqk2, Mkk2 = intra_masks(Mqk2, Mkk2, beta2, BT)
        cols = tl.arange(0, BT)
        store2(Mqk + i_hv * BT, tok, m, HV * BT, cols, col_mask(cols, BT, BT), Mqk2)
        store2(Mkk + i_hv * BT, tok, m, HV * BT, cols, col_mask(cols, BT, BT), Mkk2)


def chunk_intra(
    q: Tensor,
    k: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    slots: SlotRows,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    precision: Precision,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(Mqk, Mkk, Qt, Kend, Kt, Gam_last)`` of every chunk slot, from the flat token stream.

    Inputs: ``q, k [T, H, K]``, ``g [T, HV, K]``, ``beta [T, HV]`` as given to the public function (the options
    are applied in kernel). Outputs: ``Mqk, Mkk [T, HV, BT]`` (row ``t`` holds its chunk row; columns past the
    chunk's tokens are 0) in the compute dtype; ``Qt, Kend, Kt [T, HV, K]`` in ``precision.store``;
    ``Gam_last [NC, HV, K]`` in the compute dtype (empty slots not written).
    """
    T, H, K = q.shape
    HV = g.shape[1]
    NC = slots.start.shape[0]
    dtype = state_dtype(q)  # the compute dtype
    Mqk = q.new_empty(T, HV, BT, dtype=dtype)
    Mkk = torch.empty_like(Mqk)
    Qt = q.new_empty(T, HV, K, dtype=precision.store)
    Kend = torch.empty_like(Qt)
    Kt = torch.empty_like(Qt)
    Gl = q.new_empty(NC, HV, K, dtype=dtype)
    flag = q.new_empty(NC, HV, dtype=torch.int8)
    poison(Mqk, Mkk, Qt, Kend, Kt, Gl)
    for blocks in (False, True):
        _launch_intra(
            (NC, HV),
            (contiguous(q), contiguous(k), contiguous(g), contiguous(beta), A_log, dt_bias, Mqk, Mkk, Qt, Kend, Kt,
             Gl, flag, slots.start, slots.count, float(scale),
             gate_bound(opts), H, HV),
            dict(K=K, NB=NB, BC=BC, BT=BT, USE_L2NORM=opts.use_qk_l2norm, USE_BETA_SIGMOID=opts.use_beta_sigmoid,
                 NEG_EIGVAL=opts.allow_neg_eigval, PREC=precision.intra, DT=compute_dtype(q), ASPAN=ANCHOR_SPAN,
                 SPAN=FACTOR_SPAN, BLOCKS=blocks, **gate_flags(opts, A_log, dt_bias), **launch("intra", LAUNCH, BK=K)),
        )  # fmt: skip
    return Mqk, Mkk, Qt, Kend, Kt, Gl


_launch_intra = Launcher(chunk_intra_kernel)


@triton.jit
def chunk_solve_kernel(
    Mkk, W, v, beta, Tm, U, slot_start, slot_count, HV,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr,
    BT: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, PREC_SOLVE: tl.constexpr,
    PREC_WY: tl.constexpr, DT: tl.constexpr, STORE_TM: tl.constexpr,
):  # fmt: skip
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count == 0:
        return
    cols = tl.arange(0, BT)
    m_c = col_mask(cols, BT, BT)
    Mkk2 = load2(Mkk + i_hv * BT, tok, m, HV * BT, cols, m_c, DT)
    beta2 = load_beta2(beta, tok, m, HV, i_hv, USE_BETA_SIGMOID, NEG_EIGVAL, DT)
    solve_wy(
        Mkk2,
        beta2,
        v,
        W,
        U,
        Tm,
        tok,
        m,
        i_hv,
        HV,
        K,
        V,
        BK,
        BV,
        NB,
        BC,
        BT,
        PREC_SOLVE,
        PREC_WY,
        DT,
        STORE_TM,
        1.0,
        False,
    )


def chunk_solve(
    Mkk: Tensor,
    Kt: Tensor,
    v: Tensor,
    beta: Tensor,
    slots: SlotRows,
    opts: Options,
    precision: Precision,
    store_tm: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(Tm, W, U)`` of every chunk slot: ``Tm [T, HV, BT]`` in the compute dtype, ``W [T, HV, K]`` and
    ``U [T, HV, V]`` in ``precision.store``. ``Mkk`` and ``Kt [T, HV, K]`` as from
    :func:`chunk_intra`; ``W`` is written over ``Kt`` (the returned ``W`` is ``Kt``).
    ``v [T, HV, V]``, ``beta [T, HV]`` as given to the public function. ``store_tm=False`` (the forward) leaves
    ``Tm`` unwritten (and unallocated: an empty tensor); only the backward reads it."""
    T, HV, K = Kt.shape
    V = v.shape[2]
    NC = slots.start.shape[0]
    Tm = torch.empty_like(Mkk) if store_tm else Mkk.new_empty(0)
    U = v.new_empty(T, HV, V, dtype=Kt.dtype)
    poison(Tm, U)
    _launch_solve(
        (NC, HV),
        (contiguous(Mkk), Kt, contiguous(v), contiguous(beta), Tm, U, slots.start, slots.count, HV),
        dict(K=K, V=V, NB=NB, BC=BC, BT=BT, USE_BETA_SIGMOID=opts.use_beta_sigmoid, NEG_EIGVAL=opts.allow_neg_eigval,
             PREC_SOLVE=precision.solve, PREC_WY=precision.wy, DT=compute_dtype(Mkk), STORE_TM=store_tm,
             **launch("solve", LAUNCH, BK=K, BV=V)),
    )  # fmt: skip
    return Tm, Kt, U


_launch_solve = Launcher(chunk_solve_kernel)


def chunk_fwd_staged(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    output_final_state: bool,
    precision: Precision | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`chunk_fwd` one stage at a time, every intermediate through memory (same contract)."""
    B, T = q.shape[:2]
    v = contiguous(v)
    o, final = forward_outputs(q, v, cu_seqlens, output_final_state)
    h0 = None if initial_state is None else contiguous(initial_state.to(state_dtype(v)))
    if B * T == 0:
        return o, final_without_tokens(final, h0, output_final_state)
    p = precision or precision_for(v.dtype)
    slots = slot_map(cu_seqlens, B, T, v.device)
    cu = slots.cu
    qf, kf, vf, gf, bf = (flat(x) for x in (q, k, v, g, beta))
    A_log, dt_bias = _opt(A_log), _opt(dt_bias)
    Mqk, Mkk, Qt, Kend, Kt, Gl = chunk_intra(qf, kf, gf, bf, scale, slots, A_log, dt_bias, opts, p)
    _, W, U = chunk_solve(Mkk, Kt, vf, bf, slots, opts, p, store_tm=False)
    poison(final)
    Hin, E = chunk_state(W, U, Kend, Gl, h0, cu, p, final=final if output_final_state else None,
                         offsets=slots.offset)  # fmt: skip
    chunk_output(Qt, Mqk, Hin, E, slots, p, o.dtype, out=o.view(B * T, *o.shape[2:]))
    return o, final


def chunk_local_cumsum(
    g: Tensor, slots: SlotRows, A_log: Tensor | None, dt_bias: Tensor | None, opts: Options
) -> tuple[Tensor, Tensor]:
    """``Gam [T, HV, K]`` (chunk-local cumulative log decay, after the gate) and ``Gam_last [NC, HV, K]``.

    ``g [T, HV, K]`` is the flat token stream; the chunks are the slots of ``slots``. Both outputs are in the
    compute dtype (fp32, fp64 for fp64 inputs); rows of empty slots in ``Gam_last`` are not written.
    """
    T, HV, K = g.shape
    NC = slots.start.shape[0]
    dtype = state_dtype(g)  # the compute dtype
    Gam = g.new_empty(T, HV, K, dtype=dtype)
    Gl = g.new_empty(NC, HV, K, dtype=dtype)
    poison(Gam, Gl)
    BK = min(pow2(K), 64)
    chunk_cumsum_kernel[(NC, HV, cdiv(K, BK))](
        contiguous(g), A_log, dt_bias, Gam, Gl, slots.start, slots.count, gate_bound(opts), HV,
        K=K, BK=BK, BT=BT, DT=compute_dtype(g), **gate_flags(opts, A_log, dt_bias), **launch("cumsum", LAUNCH),
    )  # fmt: skip
    return Gam, Gl


@triton.jit
def chunk_cumsum_kernel(
    g, A_log, dt_bias, Gam, Gl, slot_start, slot_count, lower_bound, HV,
    K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    DT: tl.constexpr,
):  # fmt: skip
    """Key tile ``program_id(2)`` of every chunk slot and value head: ``Gam`` and ``Gam_last`` after the gate."""
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count == 0:
        return
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = col_mask(o_k, K, BK)
    g2 = load_log_decay(g + i_hv * K, A_log, dt_bias, tok, m, HV * K, o_k, m_k, i_hv, lower_bound, K,
                        USE_GATE, HAS_A_LOG, HAS_DT_BIAS, USE_LOWER_BOUND, DT)  # fmt: skip
    G, to_end, gl, E = chunk_decays(g2, BT)
    store2(Gam + i_hv * K, tok, m, HV * K, o_k, m_k, G)
    tl.store(Gl + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, gl.to(Gl.dtype.element_ty), mask=m_k)
