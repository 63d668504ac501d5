"""Backward stage 3b: per chunk, the key-side gradients dq, dk, dg and the rest of dbeta.

One program per (chunk slot, value head) walks the key tiles. Per tile (``docs/math.md``, "Chunk backward")::

    dQt = dO S^T,   dKend = E dS'^T                               (a loop over value tiles)
    through Mqk = s (q, k) pairwise products, dX = s dMqk;  through Mkk = beta (k, k) pairwise products,
        dX = diag(beta) dMkk,  and  dbeta_i += sum_j dMkk_ij P_ij  (P = Mkk / beta_i, never divided)
    dq   = da_qk + s exp(Gam) dQt
    dk   = db_qk + da_kk + db_kk + exp(Gam) dKt + exp(Gam_last - Gam) dKend
    dGam = q da_qk - k db_qk + k da_kk - k db_kk + Qt dQt + Kt dKt - Kend dKend
    dGam_last += sum_i Kend_i dKend_i + exp(Gam_last) rowsum(dS' * S)
    dg   = reverse cumulative sum of dGam within the chunk

and, with the l2norm where :func:`norm_in_epilogue` allows, an epilogue that turns the chunk's dq, dk into the raw
rows' gradients ``dx = r (dy - y (y . dy))``. ``dg`` is written over the dv stage's ``Gam``, each key tile's after its
last read of ``Gam``: the stage allocates no buffer for it.

Pairwise products ``X[i,j] = sum_d a_id b_jd exp(Gam_id - Gam_jd)`` (``j <= i``) take one of two passes, as in the
forward's stage 2 (:mod:`~kda_ops.triton.chunk.intra`):

- **anchored** (the usual case: every ``|Gam_i - Gam_mid| <= ANCHOR_SPAN`` over the chunk's rows, ``mid = 31``):
  ``R = e^{Gam - Gam_mid}``, ``da = (dX (b e^{-E})) R``, ``db = (dX^T (a R)) e^{-E}``: for ``Mqk`` and ``Mkk``
  together two tensor-core products per key tile, over ``[dMqk; dMkk]`` stacked (:func:`anchored_bwd`). Every
  factor stays within ``e^{+-80}``; ``dX`` is zero above the diagonal, so no future pair contributes. Against the
  block pass for every chunk, the stage at B1 T32768 H32 bf16 on an H200: 16.7 -> 9.0 ms.
- **block** (a chunk beyond the span, flagged by the first pass; a second launch takes only those), per 16-row
  block pair:

  - diagonal blocks elementwise, ``exp(Gam_i - Gam_j)`` with ``j <= i`` only (exponent <= 0), one column ``j`` at
    a time: ``[BC, BK]`` temporaries, where the ``[BC, BC, BK]`` form of all columns at once spills kilobytes of
    registers per thread (ptxas, sm_90, K = V = 128);
  - an earlier column block ``J`` factored around its last row ``n``: ``exp(Gam_i - Gam_n) exp(Gam_n - Gam_j)``,
    both exponents <= 0, so no factor exceeds 1 whatever the gates (a hard reset of -1000 underflows to 0, as
    it should). ``da_I += (dX_IJ (b_J e^{Gam_n - Gam_J})) e^{Gam_I - Gam_n}``,
    ``db_J += (dX_IJ^T (a_I e^{Gam_I - Gam_n})) e^{Gam_n - Gam_J}``: two tensor-core products per block pair.

Every exponent is clamped at 0 before ``exp``, so padding rows (whose loads are 0) stay finite and drop out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.triton.chunk.decays import gam_tile
from kda_ops.triton.chunk.precision import exact_bf16
from kda_ops.triton.chunk.tiles import (
    ANCHOR_SPAN,
    BC,
    BT,
    NB,
    chunk_grid,
    chunk_item,
    col_mask,
    load2,
    load2n,
    max2,
    row_factors,
    scale_rows,
    slot_rows,
    store2,
)
from kda_ops.triton.lang import l2norm_bwd, mm, split_rows, stack_rows
from kda_ops.triton.launch import compute_dtype, contiguous, launch, poison, pow2
from kda_ops.varlen import SlotRows


@triton.jit
def pairwise_bwd(q, k, Nq, Nk, Gam, beta, dMqk, dMkk, tok0, count, i_h, i_hv, H, HV, scale, o_k, m_k,
                 K: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
                 PREC: tl.constexpr, DT: tl.constexpr, NORMS: tl.constexpr):
    """Gradients through the pairwise products of one key tile: ``(da_qk, da_kk, db_qk + db_kk)`` ``[BT, BK]`` and
    ``rowsum(dMkk * P)`` ``[BT]`` (the tile's share of dbeta). Sub-blocks are loaded from memory; ``NORMS``: q and k
    rows times their l2norm factors ``Nq``, ``Nk`` as they load."""
    r = tl.arange(0, BC)
    blk3 = tl.arange(0, NB)[:, None, None]
    blk2 = tl.arange(0, NB)[:, None]
    m_bc = col_mask(r, BC, BC)
    DqA = tl.zeros((NB, BC, BK), dtype=DT)
    DkA = tl.zeros((NB, BC, BK), dtype=DT)
    DkB = tl.zeros((NB, BC, BK), dtype=DT)
    Dbk = tl.zeros((NB, BC), dtype=DT)
    for I in range(NB):  # noqa: E741 (row block I, column block J: the notation of the math)
        rI = I * BC + r
        tI = tok0 + rI
        mI = rI < count
        qI = load2n(q + i_h * K, Nq, tI, mI, H * K, o_k, m_k, i_h, H, DT, NORMS)  # [BC, BK]
        kI = load2n(k + i_h * K, Nk, tI, mI, H * K, o_k, m_k, i_h, H, DT, NORMS)
        GI = load2(Gam + i_hv * K, tI, mI, HV * K, o_k, m_k, DT)
        bI = tl.load(beta + tI * HV + i_hv, mask=mI, other=0.0).to(DT)  # [BC]
        daq = tl.zeros((BC, BK), dtype=DT)
        dak = tl.zeros((BC, BK), dtype=DT)  # without beta_i: rowsum(k * dak) is the dbeta share
        for J in range(0, I + 1):
            cJ = J * BC + r
            tJ = tok0 + cJ
            mJ = cJ < count
            Xq = load2(dMqk + i_hv * BT, tI, mI, HV * BT, cJ, m_bc, DT)  # [BC, BC]
            Xk = load2(dMkk + i_hv * BT, tI, mI, HV * BT, cJ, m_bc, DT)
            kJ = load2n(k + i_h * K, Nk, tJ, mJ, H * K, o_k, m_k, i_h, H, DT, NORMS)
            GJ = load2(Gam + i_hv * K, tJ, mJ, HV * K, o_k, m_k, DT)
            if J < I:
                n = J * BC + BC - 1
                # a block mask, not block & scalar: triton 3.9's interpreter rejects the mixed form
                m_n = m_k & ((o_k * 0 + n) < count)
                Gn = tl.load(Gam + (tok0 + n) * HV * K + i_hv * K + o_k, mask=m_n, other=0.0).to(DT)
                eJ = tl.exp(tl.minimum(Gn[None, :] - GJ, 0.0))  # [BC, BK] <= 1
                eI = tl.exp(tl.minimum(GI - Gn[None, :], 0.0))
                kJe = kJ * eJ
                # dMqk, dMkk as the products' first operands, as in anchored_bwd
                daq += mm(Xq, kJe, PREC, DT) * (eI * scale)
                dak += mm(Xk, kJe, PREC, DT) * eI
                dbJ = mm(tl.trans(Xq), qI * eI, PREC, DT) * (eJ * scale)
                dbJ += mm(tl.trans(Xk), (kI * eI) * bI[:, None], PREC, DT) * eJ
            else:
                # the diagonal block, exactly, one column j at a time: [BC, BK] temporaries instead of
                # [BC, BC, BK] ones (those spill kilobytes of registers per thread on sm_90)
                dbJ = tl.zeros((BC, BK), dtype=DT)
                for jj in range(BC):
                    cj = J * BC + jj
                    m_j = m_k & ((o_k * 0 + cj) < count)  # a block mask (see m_n above)
                    kj = tl.load(k + (tok0 + cj) * H * K + i_h * K + o_k, mask=m_j, other=0.0).to(DT)  # [BK]
                    if NORMS:
                        kj = kj * tl.load(Nk + (tok0 + cj) * H + i_h + o_k * 0, mask=m_j, other=0.0).to(DT)
                    Gj = tl.load(Gam + (tok0 + cj) * HV * K + i_hv * K + o_k, mask=m_j, other=0.0).to(DT)
                    xq = tl.load(dMqk + tI * HV * BT + i_hv * BT + cj, mask=mI, other=0.0).to(DT) * scale  # [BC]
                    xk = tl.load(dMkk + tI * HV * BT + i_hv * BT + cj, mask=mI, other=0.0).to(DT)
                    dec = tl.where(r[:, None] >= jj, tl.exp(tl.minimum(GI - Gj[None, :], 0.0)), 0.0)  # [BC, BK]
                    daq += xq[:, None] * kj[None, :] * dec
                    dak += xk[:, None] * kj[None, :] * dec
                    dbj = tl.sum((xq[:, None] * qI + (xk * bI)[:, None] * kI) * dec, axis=0)  # [BK]
                    dbJ = tl.where(r[:, None] == jj, dbj[None, :], dbJ)
            DkB += tl.where(blk3 == J, dbJ[None, :, :], 0.0)
        DqA += tl.where(blk3 == I, daq[None, :, :], 0.0)
        DkA += tl.where(blk3 == I, (bI[:, None] * dak)[None, :, :], 0.0)
        Dbk += tl.where(blk2 == I, tl.sum(kI * dak, axis=1)[None, :], 0.0)
    return (tl.reshape(DqA, (BT, BK)), tl.reshape(DkA, (BT, BK)), tl.reshape(DkB, (BT, BK)),
            tl.reshape(Dbk, (BT,)))  # fmt: skip


@triton.jit
def load_dm(dMqk, dMkk, tok0, count, i_hv, HV, BT: tl.constexpr):
    """``[dMqk; dMkk]`` of the chunk as one ``[2 BT, BT]`` tile, in its stored dtype."""
    cols = tl.arange(0, BT)
    r2 = tl.arange(0, 2 * BT)
    row = r2 % BT
    base = tl.where(r2 < BT, dMqk, dMkk) + i_hv * BT
    return tl.load(base[:, None] + (tok0 + row)[:, None] * (HV * BT) + cols[None, :], mask=(row < count)[:, None],
                   other=0.0)  # fmt: skip


@triton.jit
def anchored_bwd(qq, kk, G, Gmid, X2h, dMqk, dMkk, beta, tok, m, tok0, count, i_hv, HV, scale, BT: tl.constexpr,
                 PREC: tl.constexpr, DT: tl.constexpr, SPAN: tl.constexpr, HELD: tl.constexpr):  # fmt: skip
    """:func:`pairwise_bwd`'s four results for one key tile ``[BT, BK]`` by the anchored factors (module docstring):
    ``G`` the tile's Gam and ``Gmid [BK]`` its anchor row; ``tok0``, ``count`` the chunk's first row and length.
    ``HELD``: ``X2h`` is the chunk's ``[dMqk; dMkk]`` loaded before the key loop (:func:`load_dm`); otherwise the
    tile loads it.

    The four products are two, over ``[dMqk; dMkk]`` as one ``[2 BT, BT]`` tile: ``[dMqk; dMkk] (k e^{-E})`` with
    ``2 BT`` rows, and ``[dMqk; dMkk]^T [s q R; k R b]`` with a ``2 BT``-deep contraction, each shared operand staged
    once (the stage at B1 T32768 H32 bf16 on an H100: 5.52 -> 5.13 ms against four products). The stored ``dMqk``,
    ``dMkk`` are the first operands, scale and beta outside them: exact in TF32 (16-bit storage), which ``"tf32x2"``
    needs."""
    E = tl.where(m[:, None], G - Gmid[None, :], 0.0)  # padding rows: factors 1, their X rows and columns are 0
    R = tl.exp(tl.minimum(E, SPAN))
    eN = tl.exp(tl.minimum(-E, SPAN))
    b = tl.load(beta + tok * HV + i_hv, mask=m, other=0.0).to(DT)
    X2 = (X2h if HELD else load_dm(dMqk, dMkk, tok0, count, i_hv, HV, BT)).to(DT)
    daq, dak = split_rows(mm(X2, kk * eN, PREC, DT))
    daq = daq * (R * scale)
    dak = dak * R
    dbk = mm(tl.trans(X2), stack_rows((qq * R) * scale, (kk * R) * b[:, None]), PREC, DT)
    return daq, b[:, None] * dak, dbk * eN, tl.sum(kk * dak, axis=1)


@triton.jit
def value_products(Hin, dSp, dO, E, doA, eA, s_off, tok, m, i_hv, HV, o_k, m_k, V: tl.constexpr, BV: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, PREC_OH: tl.constexpr, PREC_ED: tl.constexpr,
                   DT: tl.constexpr, BVA: tl.constexpr, HELD: tl.constexpr):  # fmt: skip
    """The key tile's products with the chunk's state and its gradient, in one pass over the value tiles (each
    ``Hin`` tile loaded once): ``dQt = dO Hin^T``, ``dKe = E dS'^T`` ``[BT, BK]`` and ``rowsum(dS' * Hin) [BK]``.
    ``HELD``: ``doA``, ``eA`` are the chunk's whole ``dO``, ``E`` rows ``[BT, BVA]`` (``BVA = pow2(V)``), loaded
    before the key loop, and each product takes the whole value width at once."""
    if HELD:
        o_v = tl.arange(0, BVA)
        m_v = col_mask(o_v, V, BVA)
        m_s = m_k[:, None] & m_v[None, :]
        p_s = s_off + o_k[:, None] * V + o_v[None, :]
        h = tl.load(Hin + p_s, mask=m_s, other=0.0).to(DT)  # [BK, BVA]
        dsp = tl.load(dSp + p_s, mask=m_s, other=0.0).to(DT)
        dQt = mm(doA.to(DT), tl.trans(h), PREC_OH, DT)
        dKe = mm(eA.to(DT), tl.trans(dsp), PREC_ED, DT)
        dsh = tl.sum(dsp * h, axis=1)
    else:
        dQt = tl.zeros((BT, BK), dtype=DT)
        dKe = tl.zeros((BT, BK), dtype=DT)
        dsh = tl.zeros((BK,), dtype=DT)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = col_mask(o_v, V, BV)
            m_s = m_k[:, None] & m_v[None, :]
            p_s = s_off + o_k[:, None] * V + o_v[None, :]
            h = tl.load(Hin + p_s, mask=m_s, other=0.0).to(DT)  # [BK, BV]
            do = load2(dO + i_hv * V, tok, m, HV * V, o_v, m_v, DT)  # [BT, BV]
            dsp = tl.load(dSp + p_s, mask=m_s, other=0.0).to(DT)
            e = load2(E + i_hv * V, tok, m, HV * V, o_v, m_v, DT)
            dQt += mm(do, tl.trans(h), PREC_OH, DT)
            dKe += mm(e, tl.trans(dsp), PREC_ED, DT)
            dsh += tl.sum(dsp * h, axis=1)
    return dQt, dKe, dsh


@triton.jit
def chunk_bwd_dqk_kernel(
    q, k, Nq, Nk, g, Gam, Gl, beta, dMqk, dMkk, dKt, Hin, E, dSp, dO, dbeta_in, dq, dk, dg, dbeta, dqx, dkx, flag,
    slot_start, slot_count, scale, H, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, PREC_OH: tl.constexpr,
    PREC_ED: tl.constexpr, DT: tl.constexpr, ASPAN: tl.constexpr, BLOCKS: tl.constexpr,
    NORMS: tl.constexpr, NORM_BWD: tl.constexpr, BKE: tl.constexpr, BKG: tl.constexpr, BVA: tl.constexpr,
    PREFETCH: tl.constexpr = 0, HOLD_DM: tl.constexpr = 0, HOLD_DOE: tl.constexpr = 0,
):  # fmt: skip
    """Two passes over the chunk slots, as stage 2 of the forward. ``BLOCKS = False``: the anchored pass; a chunk
    with a ``|Gam - Gam_mid|`` beyond ``ASPAN`` is flagged (``flag = 1``). ``BLOCKS = True``: the block pass, for the
    flagged chunks only, overwriting what the anchored pass stored for them; it first forms their ``Gam`` from ``g``
    again (``dg`` may be ``Gam``'s buffer, which the anchored pass wrote over) in key tiles of ``BKG`` columns.

    ``NORM_BWD`` (with ``NORMS``, one value head per key head): ``dq``, ``dk`` are scratch, and ``dqx``, ``dkx`` take
    the gradients of the raw rows through their l2norm (:func:`~kda_ops.triton.lang.l2norm_bwd`), from whole rows
    (``BKE = pow2(K)``) read back from the program's own stores after the key loop. The loop carries no sums for
    it: sums of ``y . dy`` kept live through the loop cost the stage more than the whole read-back.

    The anchored pass's schedule (:data:`~kda_ops.triton.launch.LAUNCH` flags, the kernel's default 0, the stage's
    entries ``PREFETCH=1``; the block pass takes none): ``PREFETCH`` 1 loads the next key tile's ``q``, ``k``, ``Gam``
    before the tile's stores (2: its ``dKt`` too), so that they issue without waiting for the stores (the next tile's
    columns are not those the stores write); ``HOLD_DM`` loads ``[dMqk; dMkk]`` once before the key loop instead of per
    tile; ``HOLD_DOE`` the chunk's ``dO`` and ``E`` rows ``[BT, BVA]`` too (:func:`value_products`; built for V <= 128).
    ``PREFETCH`` and ``HOLD_DM`` compute the same values; ``HOLD_DOE`` sums each state product over the whole value
    width in one product, so where V spans several value tiles it rounds differently."""
    i_c, i_hv = chunk_item(HV)
    i_h = i_hv // (HV // H)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count == 0:
        return
    p_flag = flag + i_c.to(tl.int64) * HV + i_hv
    tok0 = tl.load(slot_start + i_c).to(tl.int64)
    rows = tl.arange(0, BT)
    # the anchor row (the forward's: mid = BT / 2 - 1), or the last token of a shorter chunk
    p_mid = Gam + (tok0 + tl.minimum(BT // 2 - 1, count - 1)) * HV * K + i_hv * K
    if BLOCKS:
        if tl.load(p_flag) == 0:
            return
        # Gam again, from g, in the dv stage's tile width (BKG): the prefix sum's order follows the tile's layout,
        # which then matches the dv stage's for fp32 inputs (sm_90, triton 3.6); for 16-bit inputs the dv stage
        # takes another layout and a re-formed Gam may differ from the stored one in its last bit
        for i_k in range(tl.cdiv(K, BKG)):
            o_k = i_k * BKG + tl.arange(0, BKG)
            m_k = col_mask(o_k, K, BKG)
            store2(Gam + i_hv * K, tok, m, HV * K, o_k, m_k, gam_tile(g, tok, m, i_hv, HV, o_k, m_k, K, DT))
        tl.debug_barrier()  # pairwise_bwd reads rows that other threads stored
    # the anchored pass checks the span on the tiles it loads anyway and stores a flagged chunk's (finite, clamped)
    # tiles regardless: the block pass overwrites every output of that chunk
    ok = True
    s_off = (i_c.to(tl.int64) * HV + i_hv) * K * V
    db = tl.load(dbeta_in + tok * HV + i_hv, mask=m, other=0.0).to(DT)
    rq = row_factors(Nq, tok, m, i_h, H, DT, NORMS)  # the l2norm factors of the chunk's q and k rows (or 1.0)
    rk = row_factors(Nk, tok, m, i_h, H, DT, NORMS)
    if HOLD_DM and not BLOCKS:
        X2 = load_dm(dMqk, dMkk, tok0, count, i_hv, HV, BT)  # [2 BT, BT]
    else:
        X2 = tl.zeros((2 * BT, BT), dtype=DT)  # not read
    if HOLD_DOE and not BLOCKS:
        o_v = tl.arange(0, BVA)
        m_v = col_mask(o_v, V, BVA)
        doA = load2(dO + i_hv * V, tok, m, HV * V, o_v, m_v, dO.dtype.element_ty)  # [BT, BVA]
        eA = load2(E + i_hv * V, tok, m, HV * V, o_v, m_v, E.dtype.element_ty)
    else:
        doA = tl.zeros((BT, BVA), dtype=DT)  # not read
        eA = tl.zeros((BT, BVA), dtype=DT)
    if PREFETCH > 0 and not BLOCKS:
        # the first key tile's q, k, Gam (and dKt), carried from one tile to the next (no name of the loop's own:
        # a name assigned before the loop and in it becomes a loop-carried value)
        o_n = tl.arange(0, BK)
        m_n = col_mask(o_n, K, BK)
        qn = load2(q + i_h * K, tok, m, H * K, o_n, m_n, DT)
        kn = load2(k + i_h * K, tok, m, H * K, o_n, m_n, DT)
        Gn = load2(Gam + i_hv * K, tok, m, HV * K, o_n, m_n, DT)
        dkn = load2(dKt + i_hv * K, tok, m, HV * K, o_n, m_n, DT) if PREFETCH > 1 else 0.0
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = col_mask(o_k, K, BK)
        # the terms are added as they come, each tile dropped after its last use, so that few [BT, BK] tiles are
        # live at a time (the kernel spills kilobytes of registers per thread when all of them are)
        if BLOCKS:
            daq, dak, dbk, dbeta_kk = pairwise_bwd(q, k, Nq, Nk, Gam, beta, dMqk, dMkk, tok0, count, i_h, i_hv, H,
                                                   HV, scale, o_k, m_k, K, BK, NB, BC, BT, PREC, DT, NORMS)  # fmt: skip
            qq = scale_rows(load2(q + i_h * K, tok, m, H * K, o_k, m_k, DT), rq, NORMS)  # [BT, BK]
            kk = scale_rows(load2(k + i_h * K, tok, m, H * K, o_k, m_k, DT), rk, NORMS)
            Gm = load2(Gam + i_hv * K, tok, m, HV * K, o_k, m_k, DT)
        elif PREFETCH > 0:
            qq = scale_rows(qn, rq, NORMS)
            kk = scale_rows(kn, rk, NORMS)
            Gm = Gn
        else:
            qq = scale_rows(load2(q + i_h * K, tok, m, H * K, o_k, m_k, DT), rq, NORMS)
            kk = scale_rows(load2(k + i_h * K, tok, m, H * K, o_k, m_k, DT), rk, NORMS)
            Gm = load2(Gam + i_hv * K, tok, m, HV * K, o_k, m_k, DT)
        if not BLOCKS:
            Gmid = tl.load(p_mid + o_k, mask=m_k, other=0.0).to(DT)
            ok = ok & (max2(tl.where(m[:, None], tl.abs(Gm - Gmid[None, :]), 0.0)) <= ASPAN)
            daq, dak, dbk, dbeta_kk = anchored_bwd(qq, kk, Gm, Gmid, X2, dMqk, dMkk, beta, tok, m, tok0, count, i_hv,
                                                   HV, scale, BT, PREC, DT, ASPAN, HOLD_DM)  # fmt: skip
        dkt = dkn if PREFETCH > 1 and not BLOCKS else load2(dKt + i_hv * K, tok, m, HV * K, o_k, m_k, DT)
        db += dbeta_kk
        dq_t = daq
        dk_t = dak + dbk
        dGam = qq * daq + kk * (dak - dbk)
        # dQt = dO S^T, dKend = E dS'^T and rowsum(dS' * S) (for the state decay), in one pass over the value tiles
        dQt, dKe, dsh = value_products(Hin, dSp, dO, E, doA, eA, s_off, tok, m, i_hv, HV, o_k, m_k, V, BV, BT, BK,
                                       PREC_OH, PREC_ED, DT, BVA, HOLD_DOE and not BLOCKS)  # fmt: skip
        eG = tl.exp(Gm)  # Gam <= 0 and Gam_last - Gam <= 0: both at most 1 (padding rows load 0 and drop out)
        sdQt = scale * eG * dQt
        dq_t += sdQt
        dGam += qq * sdQt
        edkt = eG * dkt
        dk_t += edkt
        dGam += kk * edkt
        gl = tl.load(Gl + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(DT)
        eE = tl.exp(gl[None, :] - Gm)
        Ke = kk * eE
        dk_t += eE * dKe
        dGam -= Ke * dKe
        if PREFETCH > 0 and not BLOCKS:
            o_n = (i_k + 1) * BK + tl.arange(0, BK)
            m_n = col_mask(o_n, K, BK)
            r_n = m & (i_k + 1 < tl.cdiv(K, BK))  # no rows after the last tile: nothing is loaded
            qn = load2(q + i_h * K, tok, r_n, H * K, o_n, m_n, DT)
            kn = load2(k + i_h * K, tok, r_n, H * K, o_n, m_n, DT)
            Gn = load2(Gam + i_hv * K, tok, r_n, HV * K, o_n, m_n, DT)
            if PREFETCH > 1:
                dkn = load2(dKt + i_hv * K, tok, r_n, HV * K, o_n, m_n, DT)
        # the tile's stores after all of its loads: a load after a store it might alias cannot be issued early
        store2(dq + i_hv * K, tok, m, HV * K, o_k, m_k, dq_t)
        store2(dk + i_hv * K, tok, m, HV * K, o_k, m_k, dk_t)
        dGl = tl.sum(Ke * dKe, axis=0) + tl.exp(gl) * dsh
        dGam += tl.where(rows[:, None] == BT - 1, dGl[None, :], 0.0)
        tl.debug_barrier()  # every thread's reads of the tile's Gam before dg is stored over it
        store2(dg + i_hv * K, tok, m, HV * K, o_k, m_k, tl.cumsum(dGam, axis=0, reverse=True))
    tl.store(dbeta + tok * HV + i_hv, db.to(dbeta.dtype.element_ty), mask=m)
    if not BLOCKS:
        tl.store(p_flag, tl.where(ok, 0, 1).to(flag.dtype.element_ty))
    if NORM_BWD:
        # the rows read back were stored by other threads of the program
        tl.debug_barrier()
        o_k = tl.arange(0, BKE)
        m_k = col_mask(o_k, K, BKE)
        y = load2(q + i_h * K, tok, m, H * K, o_k, m_k, DT) * rq[:, None]
        store2(dqx + i_h * K, tok, m, H * K, o_k, m_k, l2norm_bwd(y, rq[:, None], load2(dq + i_hv * K, tok, m, HV * K,
                                                                                         o_k, m_k, DT), 1))
        y = load2(k + i_h * K, tok, m, H * K, o_k, m_k, DT) * rk[:, None]
        store2(dkx + i_h * K, tok, m, H * K, o_k, m_k, l2norm_bwd(y, rk[:, None], load2(dk + i_hv * K, tok, m, HV * K,
                                                                                         o_k, m_k, DT), 1))


def norm_in_epilogue(H: int, HV: int, K: int) -> bool:
    """Whether the stage can apply the l2norm's gradient itself: one value head per key head (a group's heads are
    summed first otherwise) and whole rows within registers (K = 256 on top of the key loop spills 24 B per thread,
    ptxas, sm_90, bf16)."""
    return HV == H and K <= 128


def chunk_bwd_dqk(
    q: Tensor,
    k: Tensor,
    Gam: Tensor,
    Gl: Tensor,
    beta: Tensor,
    dMqk: Tensor,
    dMkk: Tensor,
    dKt: Tensor,
    Hin: Tensor,
    E: Tensor,
    dSp: Tensor,
    dO: Tensor,
    dbeta_partial: Tensor,
    scale: float,
    slots: SlotRows,
    prec: str,
    norms: Tensor | None = None,
    prec_state: str | None = None,
    norm_dtype: torch.dtype | None = None,
    *,
    g: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dg [T, HV, K], dbeta [T, HV])`` per value head, in the compute dtype (``Gl``'s); with
    ``norm_dtype``, dq and dk ``[T, H, K]`` in that dtype (below).

    Prepared ``q, k [T, H, K]``, ``beta [T, HV]`` and log decay ``g [T, HV, K]``; ``Gam, dMqk, dMkk, dKt,
    dbeta_partial`` from stage 3a. ``Gam`` is consumed: ``dg`` is written over it, each key tile after its last read
    of the tile (the block pass forms its chunks' ``Gam`` from ``g`` again first), so that the stage allocates no
    ``[T, HV, K]`` buffer for ``dg`` (0.54 GB at B1 T32768 H32: the epilogue's ``dq``, ``dk`` outputs take it);
    ``Gl [NC, HV, K]``, ``Hin [NC, HV, K, V]``, ``E [T, HV, V]`` from the recomputed forward; ``dS' [NC, HV, K, V]``
    from the reverse scan. dq and dk are per value head: the caller sums a group's heads. ``norms [2, T, H]``
    (optional): the l2norm factors of q's and k's rows, with ``q, k`` raw (normalised as they load).

    ``norm_dtype`` (with ``norms``, where :func:`norm_in_epilogue`): dq and dk come back as the gradients of the raw
    ``q``, ``k`` through their l2norm, in ``norm_dtype``, formed in the kernel's epilogue instead of a pass that
    reads ``q``, ``k`` and the fp32 ``dq``, ``dk`` again (forward + backward at B1 T32768 H32 bf16, H100: 0.2 ms
    less).
    """
    T, H, K = q.shape
    HV = Gam.shape[1]
    V = E.shape[2]
    NC = slots.start.shape[0]
    dt = Gl.dtype  # the compute dtype (Hin may be stored in bf16)
    dq = q.new_empty(T, HV, K, dtype=dt)
    dk = q.new_empty(T, HV, K, dtype=dt)
    assert Gam.dtype == dt and Gam.is_contiguous(), "chunk_bwd_dqk: Gam, which dg is written over"
    dg = Gam
    dbeta = q.new_empty(T, HV, dtype=dt)
    flag = q.new_empty(NC, HV, dtype=torch.int8)
    fused = norm_dtype is not None
    ok = norms is not None and norm_in_epilogue(H, HV, K)
    assert not fused or ok, "chunk_bwd_dqk: norm_dtype needs norms and norm_in_epilogue"
    dqx, dkx = (q.new_empty(T, H, K, dtype=norm_dtype), q.new_empty(T, H, K, dtype=norm_dtype)) if fused else (dq, dk)
    poison(dq, dk, dbeta, dqx, dkx)
    nq, nk = (None, None) if norms is None else (norms[0], norms[1])
    ps = prec if prec_state is None else prec_state
    for blocks in (False, True):
        chunk_bwd_dqk_kernel[chunk_grid(NC, HV)](
            contiguous(q), contiguous(k), nq, nk, contiguous(g), Gam, Gl, contiguous(beta), dMqk, dMkk, dKt, Hin,
            contiguous(E), dSp, contiguous(dO), dbeta_partial, dq, dk, dg, dbeta, dqx, dkx, flag, slots.start,
            slots.count, float(scale), H, HV, K=K, V=V, NB=NB, BC=BC, BT=BT, PREC=prec, PREC_OH=exact_bf16(ps, dO, Hin),
            PREC_ED=exact_bf16(ps, E, dSp), DT=compute_dtype(Gl), ASPAN=ANCHOR_SPAN, BLOCKS=blocks,
            NORMS=norms is not None, NORM_BWD=fused, BKE=pow2(K), BKG=launch("dv", BK=K, BV=V)["BK"], BVA=pow2(V),
            **launch("dqk_blocks" if blocks else "dqk_split" if prec == "tf32x2" else "dqk", BK=K, BV=V),
        )  # fmt: skip
    return dqx, dkx, dg, dbeta


__all__ = ["anchored_bwd", "chunk_bwd_dqk", "load_dm", "norm_in_epilogue", "pairwise_bwd"]
