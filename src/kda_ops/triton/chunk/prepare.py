"""Stages 1-3 fused: everything that is local to one chunk, in one program per (chunk slot, value head).

The program computes the chunk's decays in registers (stage 1), ``Mqk``, ``Mkk``, ``Qt``, ``Kend`` (stage 2), then
``Tm = (I + Mkk)^-1`` and the WY factors (stage 3), and writes only what the later stages read. ``Gam`` and ``Mkk``
never leave the chip, nor does ``Tm`` in the forward: at T = 32k, HV = 32, K = V = 128 the fused kernels move
~2.6 GB where the stages as kernels of their own would move ~6 GB. The stage functions they call
(:mod:`~kda_ops.triton.chunk.intra`, :mod:`~kda_ops.triton.chunk.solve`) are checked stage by stage against their
oracles through the standalone kernels of the stage tests (``tests/triton/chunk/stage_kernels.py``).

The forward (:func:`chunk_prepare`) takes the *X form*: with ``Tb = Tm diag(beta)``, ``E = U - W S = Tb X`` for
``X = V - Kt S``, so the kernel stores ``Mqk Tb`` and ``Kb = Tb^T Kend`` in place of ``Mqk`` and ``Kend``, keeps
``Kt`` for the scan and forms neither ``U`` (nor reads ``v``) nor ``W``: one 64 x 64 x 64 product from registers
replaces two 64 x 64 x 128 products over loaded tiles (0.21 ms less than the E form in the forward at B1 T32768
H32 bf16 on an H200). The backward's recompute (:func:`chunk_prepare_recompute`) takes the E form:
``Mqk`` and ``Tm`` in the compute dtype, ``W``, ``U``, ``Qt``, ``Kend`` in ``precision.store``, ``Gam_last`` per
slot.

The kernels that share the work (:mod:`~kda_ops.triton.chunk.intra` explains the two paths):

- :func:`chunk_prepare_kernel` takes the anchored path for every key tile: one tensor-core product per tile, no
  16-row blocks, few registers. A chunk whose decays span too far for it (``|Gam - Gam_mid| > 80`` nats
  somewhere) is flagged and left alone.
- The forward first runs :func:`~kda_ops.triton.chunk.decays.chunk_anchor_sums`: the anchored decays' three sums
  along the rows, which the anchored kernel then loads instead of reducing across its warps.
- :func:`chunk_prepare_blocks_kernel` redoes the flagged chunks by the block path: in the forward at most one
  program per SM reads the flags :data:`~kda_ops.triton.launch.FLAG_BLOCK` at a time and runs the flagged chunks in
  turn (the recompute keeps a program per chunk). When the options bound the gate below ``-2.5`` nats per token
  (``lower_bound``), where the anchored path would often fail, it runs alone, a program per chunk, and the first
  kernel is not launched.

The grid of a program per chunk is the static chunk-slot map (:func:`kda_ops.varlen.chunk_slots`): ``cdiv(T, BT)
+ N`` slots, a program whose slot holds no token returns at once (the anchored kernel first writes its flag 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import Options, state_dtype
from kda_ops.triton.chunk.decays import chunk_anchor_sums, gate_bound, gate_flags
from kda_ops.triton.chunk.intra import (
    chunk_norms,
    intra_anchored,
    intra_blocks,
    intra_masks,
    key_compute,
    key_loads,
    key_tile,
    row_span,
)
from kda_ops.triton.chunk.precision import Precision
from kda_ops.triton.chunk.solve import kb_stored, solve_unit_lower, solve_wy
from kda_ops.triton.chunk.tiles import (
    ANCHOR_SPAN,
    BC,
    BT,
    FACTOR_SPAN,
    NB,
    chunk_grid,
    chunk_item,
    col_mask,
    load_beta2,
    slot_rows,
    store2,
)
from kda_ops.triton.lang import mm, pdl_enter, rnorm
from kda_ops.triton.launch import (
    FLAG_BLOCK,
    Launcher,
    cdiv,
    compute_dtype,
    contiguous,
    jit_any_length,
    launch,
    pdl,
    persistent_programs,
    poison,
)
from kda_ops.varlen import SlotRows


@triton.jit
def solve_and_store(
    Mqk2, Mkk2, Mqk, v, beta, W, U, Kend, Tm, tok, m, i_hv, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC_SOLVE: tl.constexpr, PREC_WY: tl.constexpr, DT: tl.constexpr,
    STORE_TM: tl.constexpr, nq, nk, FOLD: tl.constexpr,
):  # fmt: skip
    """Masks; stage 3: ``Tm = (I + Mkk)^-1``. With ``STORE_TM`` (the backward's recompute): store Mqk, ``Tm``,
    ``W = Tm diag(beta) Kt`` (``Kt`` as the key tiles left it in ``W``) and ``U = Tm diag(beta) V``. Without (the
    forward's X form): store ``Mqk Tb`` in ``Mqk`` and ``Kb = Tb^T Kend`` over ``Kend`` (``Tb = Tm diag(beta)``);
    ``W`` keeps ``Kt``. ``FOLD``: the products were formed from raw ``q, k``; ``nq, nk [BT]`` are their l2norm
    factors, applied here to rows and columns."""
    beta2 = load_beta2(beta, tok, m, HV, i_hv, USE_BETA_SIGMOID, NEG_EIGVAL, DT)
    if FOLD:
        Mqk2 = Mqk2 * nq[:, None] * nk[None, :]
        Mkk2 = Mkk2 * nk[:, None] * nk[None, :]
    Mqk2, Mkk2 = intra_masks(Mqk2, Mkk2, beta2, BT)
    cols = tl.arange(0, BT)
    if STORE_TM:
        store2(Mqk + i_hv * BT, tok, m, HV * BT, cols, col_mask(cols, BT, BT), Mqk2)
        solve_wy(Mkk2, beta2, v, W, U, Tm, tok, m, i_hv, HV, K, V, BK, BV, NB, BC, BT, PREC_SOLVE, PREC_WY, DT,
                 STORE_TM, nk, FOLD)  # fmt: skip
    else:
        Tb = solve_unit_lower(Mkk2, NB, BC, BT, PREC_SOLVE, DT) * beta2[None, :]
        store2(Mqk + i_hv * BT, tok, m, HV * BT, cols, col_mask(cols, BT, BT), mm(Mqk2, Tb, PREC_WY, DT))
        kb_stored(Tb, Kend, tok, m, i_hv, HV, K, BK, PREC_WY, DT, nk, FOLD)


@triton.jit
def store_norms(Nrm, nq, nk, tok, m, i_hv, HV, T):
    """The l2norm factors ``nq``, ``nk [BT]`` of the chunk's rows into ``Nrm [2, HV, T]`` (:func:`chunk_prepare`)."""
    tl.store(Nrm + i_hv.to(tl.int64) * T + tok, nq, mask=m)
    tl.store(Nrm + (HV + i_hv).to(tl.int64) * T + tok, nk, mask=m)


@jit_any_length
def chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, Mqk, W, U, Qt, Kend, Gl, Tm, Flag, Nrm, Rqk, Sums, slot_start, slot_count,
    scale, lower_bound, H, HV, T, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
    HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC_INTRA: tl.constexpr, PREC_SOLVE: tl.constexpr, PREC_WY: tl.constexpr,
    DT: tl.constexpr, STORE_TM: tl.constexpr, ASPAN: tl.constexpr, FOLD: tl.constexpr, PREFETCH: tl.constexpr,
    GIVEN_NORMS: tl.constexpr, GIVEN_SUMS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    i_c, i_hv = chunk_item(HV)
    i_h = i_hv // (HV // H)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count == 0:
        tl.store(Flag + i_c.to(tl.int64) * HV + i_hv, 0)  # read by the block pass
        return
    if FOLD:  # the l2norm factors from the key loop's own loads, applied after it
        rq = 1.0
        rk = 1.0
        ssq = tl.zeros((BT,), dtype=DT)
        ssk = tl.zeros((BT,), dtype=DT)
    else:
        rq, rk = chunk_norms(q, k, Rqk, tok, m, i_h, H, T, K, BK, BT, USE_L2NORM, GIVEN_NORMS, DT)
    # stages 1-2: decays, Qt, Kend, Gam_last (stored) and Mqk, Mkk (registers), anchored at the middle row
    Mqk2 = tl.zeros((BT, BT), dtype=DT)
    Mkk2 = tl.zeros((BT, BT), dtype=DT)
    span = tl.zeros((BT,), dtype=DT)
    NK: tl.constexpr = (K + BK - 1) // BK
    # PREFETCH: the next key tile loads while this one computes (its stores come first in program order, and a load
    # after a store that it might alias cannot be issued early; the last step reloads the last tile): through the
    # backward's recompute, 0.22 ms off forward + backward at B1 T32768 H32 bf16 on an H200. It is off after an
    # l2norm pass over q and k before the loop, which leaves them L2-resident: the prefetch then only costs
    # registers.
    # GIVEN_SUMS: the decays' three sums along the rows come from chunk_anchor_sums (key_compute loads them) rather
    # than from a reduction across warps here
    xq, xk, xg = key_loads(q, k, g, tok, m, i_h, i_hv, H, HV, 0, K, BK)
    for i_k in range(NK):
        if PREFETCH:
            xq_n, xk_n, xg_n = key_loads(q, k, g, tok, m, i_h, i_hv, H, HV, tl.minimum(i_k + 1, NK - 1), K, BK)
        else:
            xq, xk, xg = key_loads(q, k, g, tok, m, i_h, i_hv, H, HV, i_k, K, BK)
        if FOLD:
            ssq += tl.sum(xq.to(DT) * xq.to(DT), axis=1)
            ssk += tl.sum(xk.to(DT) * xk.to(DT), axis=1)
        qs, kk, g2, E = key_compute(xq, xk, xg, Sums, A_log, dt_bias, Qt, Kend, Gl, W, tok, m, i_c, i_hv, HV,
                                    scale, lower_bound, rq, rk, i_k, K, BK, BT, USE_GATE, HAS_A_LOG, HAS_DT_BIAS,
                                    USE_LOWER_BOUND,
                                    DT, True, GIVEN_SUMS)  # fmt: skip
        span = row_span(span, E)
        Mqk2, Mkk2 = intra_anchored(qs, kk, E, Mqk2, Mkk2, PREC_INTRA, DT, ASPAN)
        if PREFETCH:
            xq, xk, xg = xq_n, xk_n, xg_n
    far = tl.max(span, axis=0) > ASPAN
    tl.store(Flag + i_c.to(tl.int64) * HV + i_hv, far.to(tl.int32))
    if FOLD:
        nq = rnorm(ssq)
        nk = rnorm(ssk)
        store_norms(Nrm, nq, nk, tok, m, i_hv, HV, T)
    else:
        nq = 1.0
        nk = 1.0
    if not far:
        solve_and_store(Mqk2, Mkk2, Mqk, v, beta, W, U, Kend, Tm, tok, m, i_hv, HV, K, V, BK, BV, NB, BC, BT,
                        USE_BETA_SIGMOID, NEG_EIGVAL, PREC_SOLVE, PREC_WY, DT, STORE_TM, nq, nk, FOLD)  # fmt: skip


@triton.jit
def blocks_chunk(
    i_c, i_hv, q, k, v, g, beta, A_log, dt_bias, Mqk, W, U, Qt, Kend, Gl, Tm, Nrm, Rqk, slot_start, slot_count, scale,
    lower_bound, H, HV, T, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr,
    BC: tl.constexpr, BT: tl.constexpr, USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    PREC_INTRA: tl.constexpr, PREC_SOLVE: tl.constexpr, PREC_WY: tl.constexpr, DT: tl.constexpr,
    STORE_TM: tl.constexpr, SPAN: tl.constexpr, FOLD: tl.constexpr, GIVEN_NORMS: tl.constexpr,
):  # fmt: skip
    """Stages 1-3 of chunk slot ``i_c``, value head ``i_hv`` by the block path (nothing for an empty slot)."""
    i_h = i_hv // (HV // H)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count > 0:
        rq, rk = chunk_norms(q, k, Rqk, tok, m, i_h, H, T, K, BK, BT, USE_L2NORM, GIVEN_NORMS, DT)
        Mqk2 = tl.zeros((BT, BT), dtype=DT)
        Mkk2 = tl.zeros((BT, BT), dtype=DT)
        for i_k in range(tl.cdiv(K, BK)):
            qs, kk, g2, E = key_tile(q, k, g, A_log, dt_bias, Qt, Kend, Gl, W, tok, m, i_c, i_h, i_hv, H, HV, scale,
                                     lower_bound, rq, rk, i_k, K, BK, BT, USE_GATE, HAS_A_LOG, HAS_DT_BIAS,
                                     USE_LOWER_BOUND, DT,
                                     False)  # fmt: skip
            Mqk2, Mkk2 = intra_blocks(qs, kk, g2, Mqk2, Mkk2, NB, BC, BT, BK, PREC_INTRA, DT, SPAN)
        if FOLD:  # this kernel stores normalised factors: unit factors for its chunk's rows
            one = tl.full((BT,), 1.0, DT)
            store_norms(Nrm, one, one, tok, m, i_hv, HV, T)
        solve_and_store(Mqk2, Mkk2, Mqk, v, beta, W, U, Kend, Tm, tok, m, i_hv, HV, K, V, BK, BV, NB, BC, BT,
                        USE_BETA_SIGMOID, NEG_EIGVAL, PREC_SOLVE, PREC_WY, DT, STORE_TM, 1.0, 1.0, False)  # fmt: skip


@jit_any_length
def chunk_prepare_blocks_kernel(
    q, k, v, g, beta, A_log, dt_bias, Mqk, W, U, Qt, Kend, Gl, Tm, Flag, Nrm, Rqk, slot_start, slot_count, scale,
    lower_bound, H, HV, T, NI, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
    HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC_INTRA: tl.constexpr, PREC_SOLVE: tl.constexpr, PREC_WY: tl.constexpr,
    DT: tl.constexpr, STORE_TM: tl.constexpr, SPAN: tl.constexpr, CHECK_FLAG: tl.constexpr, FOLD: tl.constexpr,
    GIVEN_NORMS: tl.constexpr, FB: tl.constexpr, FLAG_LOOP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    if CHECK_FLAG and FLAG_LOOP:
        # A few programs, each reading the flags of its blocks of FB items (item i: slot i // HV, value head i % HV)
        # at once and running the flagged ones in turn. With no chunk flagged that is one vector load per block,
        # where a program per item (255 registers, 8 warps: one program per SM at a time) costs ~45 µs at T = 32k.
        lanes = tl.arange(0, FB)
        for b in range(tl.program_id(0) * FB, NI, tl.num_programs(0) * FB):
            f = tl.load(Flag + b + lanes, mask=b + lanes < NI, other=0)
            while tl.max(f, axis=0) != 0:
                j = tl.min(tl.where(f != 0, lanes, FB), axis=0)
                blocks_chunk((b + j) // HV, (b + j) % HV, q, k, v, g, beta, A_log, dt_bias, Mqk, W, U, Qt, Kend, Gl,
                             Tm, Nrm, Rqk, slot_start, slot_count, scale, lower_bound, H, HV, T, K, V, BK, BV, NB,
                             BC, BT, USE_L2NORM, USE_GATE, HAS_A_LOG, HAS_DT_BIAS, USE_LOWER_BOUND, USE_BETA_SIGMOID,
                             NEG_EIGVAL, PREC_INTRA, PREC_SOLVE, PREC_WY, DT, STORE_TM, SPAN, FOLD,
                             GIVEN_NORMS)  # fmt: skip
                f = tl.where(lanes == j, 0, f)
    else:  # a program per item (every item without CHECK_FLAG)
        i_c, i_hv = tl.program_id(0), tl.program_id(1)
        if CHECK_FLAG:
            run = tl.load(Flag + i_c.to(tl.int64) * HV + i_hv) != 0
        else:
            run = True
        if run:
            blocks_chunk(i_c, i_hv, q, k, v, g, beta, A_log, dt_bias, Mqk, W, U, Qt, Kend, Gl, Tm, Nrm, Rqk,
                         slot_start, slot_count, scale, lower_bound, H, HV, T, K, V, BK, BV, NB, BC, BT, USE_L2NORM,
                         USE_GATE, HAS_A_LOG, HAS_DT_BIAS, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL, PREC_INTRA,
                         PREC_SOLVE, PREC_WY, DT, STORE_TM, SPAN, FOLD, GIVEN_NORMS)  # fmt: skip


def anchored_path_usable(opts: Options) -> bool:
    """Whether to try the anchored path first: always, unless the gate's lower bound is known and lets half a chunk
    span more than ANCHOR_SPAN nats (below -2.5 per token; a bound of -5 then guarantees the block path's factored
    diagonal blocks, 16 x 5 = 80 nats). Decided from the options, never from data."""
    lb = opts.lower_bound if opts.use_gate else None
    return lb is None or abs(lb) * (BT // 2) <= ANCHOR_SPAN


@dataclass(frozen=True)
class XFactors:
    """The forward's per-chunk factors in the X form (``Tb = Tm diag(beta)``, ``E = Tb X`` for ``X = V - Kt S``):
    ``MqkTb [T, HV, BT]``, ``Kt, Qt, Kb [T, HV, K]`` in ``precision.store``, ``Gl [NC, HV, K]`` (``Gam_last``) in
    the compute dtype, and ``Nrm [2, HV, T]`` (compute dtype) when the l2norm is folded into the key loop (l2norm
    asked, anchored path tried), else None: ``Kt`` and ``Qt`` are then stored without the l2norm factors of their
    rows, ``Nrm[0]`` (of q) and ``Nrm[1]`` (of k); ``MqkTb`` and ``Kb`` are complete either way."""

    MqkTb: Tensor
    Kt: Tensor
    Qt: Tensor
    Kb: Tensor
    Gl: Tensor
    Nrm: Tensor | None


@dataclass(frozen=True)
class EFactors:
    """The per-chunk factors the backward reads: ``Mqk, Tm = (I + Mkk)^-1 [T, HV, BT]`` and ``Gl [NC, HV, K]`` in
    the compute dtype; ``W = Tb Kt``, ``Qt``, ``Kend [T, HV, K]`` and ``U = Tb V [T, HV, V]`` in
    ``precision.store``."""

    Mqk: Tensor
    W: Tensor
    U: Tensor
    Qt: Tensor
    Kend: Tensor
    Gl: Tensor
    Tm: Tensor


def chunk_prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    slots: SlotRows,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    precision: Precision,
) -> XFactors:
    """Stages 1-3 of every chunk slot in the forward's X form, from the flat token stream ``q, k [T, H, K]``,
    ``v [T, HV, V]``, ``g [T, HV, K]``, ``beta [T, HV]`` as given to the public function (the options applied in
    kernel). The kernel forms neither ``W`` nor ``U`` and never reads ``v``."""
    f = _prepare(q, k, v, g, beta, scale, slots, A_log, dt_bias, opts, precision, store_tm=False, norms=None)
    assert isinstance(f, XFactors)
    return f


def chunk_prepare_recompute(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    slots: SlotRows,
    precision: Precision,
    norms: Tensor | None = None,
) -> EFactors:
    """Stages 1-3 of every chunk slot for the backward, from inputs the options were already applied to
    (:mod:`~kda_ops.triton.chunk.inputs`); ``norms [2, T, H]`` (compute dtype): the l2norm factors of q's and k's
    rows, applied as the tiles load (``q * norms[0]`` is the l2-normalised q)."""
    f = _prepare(q, k, v, g, beta, scale, slots, None, None, _NO_OPTIONS, precision, store_tm=True, norms=norms)
    assert isinstance(f, EFactors)
    return f


_NO_OPTIONS = Options()


def _prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    slots: SlotRows,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    precision: Precision,
    store_tm: bool,
    norms: Tensor | None,
) -> XFactors | EFactors:
    """The two kernels' launch: the backward's factors with ``store_tm``, else the forward's X form."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    NC = slots.start.shape[0]
    store = precision.store
    Mqk = q.new_empty(T, HV, BT, dtype=state_dtype(v) if store_tm else store)
    Tm = torch.empty_like(Mqk) if store_tm else None
    W = q.new_empty(T, HV, K, dtype=store)
    Qt = torch.empty_like(W)
    Kend = torch.empty_like(W)
    U = v.new_empty(T, HV, V, dtype=store) if store_tm else None  # the X form forms no U
    Gl = q.new_empty(NC, HV, K, dtype=state_dtype(v))
    Flag = q.new_empty(NC, HV, dtype=torch.int32)
    assert norms is None or not opts.use_qk_l2norm, "chunk_prepare: l2norm factors given and asked"
    anchored = anchored_path_usable(opts)
    # The anchored kernel folds the l2norm into its key loop: the products and tiles are formed from raw q, k and the
    # factors applied after the loop (``Mqk``, ``Mkk``, ``Kb``) or by the consumers (``Qt`` by the output stage,
    # ``Kt`` by the scan), which saves the pass that loads q and k once more before the loop; with no such pass the
    # next key tile loads a step ahead (0.07 ms off the forward at B1 T32768 H32 bf16 on an H200).
    fold = anchored and opts.use_qk_l2norm
    # The l2norm factors as [2, HV, T], each head's rows contiguous, not [2, T, HV]: every program stores (and the
    # scan and the output stage load) its 64 rows' factors as one run rather than 64 values 4 * HV bytes apart: 0.11
    # ms off the forward at B1 T32768 H32 bf16 on an H200.
    Nrm = q.new_empty(2, HV, T, dtype=state_dtype(v)) if fold else None
    poison(Mqk, W, U, Qt, Kend, Gl, Tm, Flag, Nrm)
    # the two kernels' runtime arguments: these, with the anchor sums between them for the anchored kernel
    head = (contiguous(q), contiguous(k), contiguous(v), contiguous(g), contiguous(beta), A_log, dt_bias,
            Mqk, W, U, Qt, Kend, Gl, Tm, Flag, Nrm, norms)  # fmt: skip
    tail = (slots.start, slots.count, float(scale), gate_bound(opts),
            H, HV, T)  # fmt: skip
    meta = dict(
        K=K, V=V, NB=NB, BC=BC, BT=BT, USE_L2NORM=opts.use_qk_l2norm,
        USE_BETA_SIGMOID=opts.use_beta_sigmoid, NEG_EIGVAL=opts.allow_neg_eigval, PREC_INTRA=precision.intra,
        PREC_SOLVE=precision.solve, PREC_WY=precision.wy, DT=compute_dtype(v), STORE_TM=store_tm,
        GIVEN_NORMS=norms is not None,
        **gate_flags(opts, A_log, dt_bias),
        **pdl(q.device),
    )  # fmt: skip
    if anchored:
        prefetch = not opts.use_qk_l2norm or fold
        # The forward reads each key tile's three sums along the rows (``g_0``, ``P_last``, ``P_mid``) from a pass of
        # their own over ``g`` instead of reducing across the kernel's warps, its largest cost (0.08 ms off the
        # forward at B1 T32768 H32 bf16 on an H200); the backward's recompute reduces them in the kernel.
        sums = None if store_tm else chunk_anchor_sums(contiguous(g), slots, A_log, dt_bias, opts)
        _launch_prepare(chunk_grid(NC, HV), (*head, sums, *tail),
                        dict(meta, ASPAN=ANCHOR_SPAN, FOLD=fold, PREFETCH=prefetch, GIVEN_SUMS=sums is not None,
                             **launch("prepare", BK=K, BV=V)))  # fmt: skip
    # the flag loop in the forward; the backward's recompute keeps a program per item (its form of the loop spills
    # 272 B per thread with triton 3.9, over the backward's bound)
    flag_loop = anchored and not store_tm
    # The block pass forms Mqk, Mkk per 16-row block from decays factored at each block's start, not from the anchored
    # path's decays of up to 80 nats: where 3xTF32 is asked there (fp16) it takes TF32 with rounded operands, since
    # the recompute's block pass spilled 264 B per thread in 3xTF32 (triton 3.7 and 3.9), over the backward's bound.
    block_intra = "tf32rn" if precision.intra == "tf32x3" else precision.intra
    blocks_meta = dict(meta, SPAN=FACTOR_SPAN, CHECK_FLAG=anchored, FOLD=fold, FB=FLAG_BLOCK, FLAG_LOOP=flag_loop,
                       PREC_INTRA=block_intra, **launch("prepare_blocks", BK=K, BV=V))  # fmt: skip
    grid = (min(cdiv(NC * HV, FLAG_BLOCK), persistent_programs(q.device)),) if flag_loop else (NC, HV)
    _launch_blocks(grid, (*head, *tail, NC * HV), blocks_meta)
    if store_tm:
        assert U is not None and Tm is not None
        return EFactors(Mqk=Mqk, W=W, U=U, Qt=Qt, Kend=Kend, Gl=Gl, Tm=Tm)
    return XFactors(MqkTb=Mqk, Kt=W, Qt=Qt, Kb=Kend, Gl=Gl, Nrm=Nrm)


_launch_prepare = Launcher(chunk_prepare_kernel)
_launch_blocks = Launcher(chunk_prepare_blocks_kernel)

__all__ = ["chunk_prepare"]
