"""Backward stage 2: the reverse state-gradient scan, the only sequential part of the chunk backward.

One program per (sequence, value head, value tile) holds ``dS [K, BV]`` (fp32) and walks the sequence's chunks
backwards from the final-state gradient (``docs/math.md``, "Chunk backward")::

    dS' = dS                                       gradient of the state leaving the chunk (stored per slot)
    dE  = Kend dS' + Mqk^T dO                      gradient of the resolved errors         [BT, BV] (stored)
    dS  = diag(exp(Gam_last)) dS' + Qt^T dO - W^T dE     gradient of the state entering the chunk

After the first chunk ``dS`` is the gradient of the initial state (an empty sequence passes ``dht`` through). The
grid is ``(cdiv(V, BV), N * HV)``: bounds from ``cu_seqlens`` on the device, the same slot numbering as the
forward's scan (:func:`~kda_ops.triton.chunk.scan.chunk_offsets`), so nothing depends on values on the host.

``Mqk^T dO`` depends on no state: before a split scan (given the chunk slots), a pass parallel over them
(:func:`chunk_bwd_pre_kernel`) forms it into ``dE``'s rows, and each step reads it there before overwriting the rows
with ``dE``, so the step keeps the two products of its dependent chain and one off it (no new buffer: the peak
memory stays).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import state_shape
from kda_ops.triton.chunk.precision import exact_bf16
from kda_ops.triton.chunk.scan import chunk_offsets, scan_block_v, scan_segments, segment_states
from kda_ops.triton.chunk.tiles import (
    BT,
    chunk_grid,
    chunk_item,
    col_mask,
    slot_rows,
    state_offsets,
    state_tile,
    store2,
    tile2,
)
from kda_ops.triton.lang import mm
from kda_ops.triton.launch import cdiv, compute_dtype, contiguous, launch, poison, pow2
from kda_ops.varlen import SlotRows


@triton.jit
def chunk_bwd_pre_kernel(dO, Mqk, P, slot_start, slot_count, HV, V: tl.constexpr, BV: tl.constexpr,
                         BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """``P = Mqk^T dO`` per (chunk slot, value head) into ``P [T, HV, V]``: the term of ``dE`` that no state
    enters, formed for every chunk at once so that the reverse scan's step keeps only its dependent products."""
    i_c, i_hv = chunk_item(HV)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count == 0:
        return
    rows = tl.arange(0, BT)
    A = tile2(Mqk + i_hv * BT, tok, m, HV * BT, rows, col_mask(rows, BT, BT))
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = col_mask(o_v, V, BV)
        do = tile2(dO + i_hv * V, tok, m, HV * V, o_v, m_v)
        store2(P + i_hv * V, tok, m, HV * V, o_v, m_v, mm(tl.trans(A), do, PREC, DT))


@triton.jit
def chunk_tiles(dO, Mqk, Kend, Qt, W, Gl, dE, tok, m, c, i_hv, HV, o_k, m_k, o_v, m_v, rows, m_r,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr, PRE: tl.constexpr):
    """The reverse scan's inputs of chunk slot ``c`` (rows ``tok``, ``m``) in their stored dtypes: ``dO [BT, BV]``,
    ``Mqk [BT, BT]`` (with ``PRE``: ``Mqk^T dO [BT, BV]`` from ``dE``'s rows, in ``DT``), ``Kend, Qt, W [BT, BK]``,
    ``Gam_last [BK]``. The tiles off the step's dependent chain load
    first, then the chain's: the split scan's passes then keep their tiles in registers (sm_90: 255 registers, 0-8 B
    of stack, against 40-48 B), forward + backward at B1 T32768 H4 bf16 on an H200 2.39 ms against 2.42."""
    do = tile2(dO + i_hv * V, tok, m, HV * V, o_v, m_v)
    if PRE:  # P = Mqk^T dO, read from the dE rows the step then overwrites
        A = tile2(dE + i_hv * V, tok, m, HV * V, o_v, m_v).to(DT)
    else:
        A = tile2(Mqk + i_hv * BT, tok, m, HV * BT, rows, m_r)
    qt = tile2(Qt + i_hv * K, tok, m, HV * K, o_k, m_k)
    ke = tile2(Kend + i_hv * K, tok, m, HV * K, o_k, m_k)
    w = tile2(W + i_hv * K, tok, m, HV * K, o_k, m_k)
    gl = tl.load(Gl + (c * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
    return do, A, ke, qt, w, gl


@triton.jit
def chunk_bwd_scan_kernel(
    dO, Mqk, Qt, Kend, W, Gl, dht, dSp, dE, dh0, cu, chunk_off, MB, HV, NSEG,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr, STORE_INITIAL_STATE_GRADIENT: tl.constexpr, PREC: tl.constexpr,
    PREC_QO: tl.constexpr, DT: tl.constexpr, STATE_V_FIRST: tl.constexpr, PHASE: tl.constexpr, PRE: tl.constexpr,
):  # fmt: skip
    # PHASE 0: whole sequences. The split scan (as the forward's, in reverse: docs/math.md, "Segments"): PHASE 1 the
    # maps of segments 1.. from a zero gradient (value tiles: B; then the identity's columns over K: M^T), PHASE 2
    # each segment from the gradient leaving it (segment_states_kernel with REVERSE, read from dht)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    if PHASE == 1:
        NS = NSEG - 1
    else:
        NS = NSEG
    i_hv = i_nh % HV
    i_s = (i_nh // HV) % NS
    i_n = i_nh // HV // NS
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    rows = tl.arange(0, BT)
    m_r = col_mask(rows, BT, BT)
    o_k, m_k, o_v, m_v, m_s, p_s, s_off = state_tile(i_n, i_hv, i_v, HV, K, V, BK, BV)
    p_u = state_offsets(o_k, o_v, K, V, STATE_V_FIRST)  # dht and dh0 in the user's layout; dS' keeps p_s
    nc = tl.cdiv(eos - bos, BT).to(tl.int32)
    j0 = nc * 0
    if PHASE != 0:  # the segment's chunks [j0, j0 + nc) of the sequence's
        if PHASE == 1:
            seg = i_s + 1
        else:
            seg = i_s
        L = tl.cdiv(nc, NSEG)
        j0 = tl.minimum(seg * L, nc)
        nc = tl.minimum(L, nc - j0)
    m_u = m_v
    if PHASE == 1:
        # (o_m < 0 on the value tiles; vector conditions: triton 3.9's interpreter rejects a mask of tensor & scalar)
        o_m = (i_v - NV) * BV + tl.arange(0, BV)
        dS = (o_k[:, None] == o_m[None, :]).to(DT)
        m_u = m_v & (o_m < 0)
    elif PHASE == 2:
        dS = tl.load(dht + ((i_n * NSEG + i_s) * HV + i_hv) * K * V + p_s, mask=m_s, other=0.0).to(DT)
    elif USE_FINAL_STATE_GRADIENT:
        dS = tl.load(dht + s_off + p_u, mask=m_s, other=0.0).to(DT)  # [BK, BV]
    else:
        dS = tl.zeros((BK, BV), dtype=DT)
    # each chunk's tiles load together (stored dtypes) before the step's stores: a load after the store of dE, which
    # it might alias, would wait for it, a second memory round trip per step. Unlike the forward's scan, no step loads
    # the previous chunk's tiles ahead: that spills 264 B per thread (ptxas, sm_90) and costs more than it hides, the
    # reverse scan at B1 T32768 H32 bf16 on an H100 3.49 ms against 2.46.
    for jj in range(nc):
        j = j0 + nc - 1 - jj
        c = c0 + j
        tok = bos + j * BT + rows
        m = tok < eos
        do, A, ke, qt, w, gl = chunk_tiles(dO, Mqk, Kend, Qt, W, Gl, dE, tok, m, c, i_hv, HV, o_k, m_k, o_v, m_u,
                                           rows, m_r, K, V, BT, DT, PRE)  # fmt: skip
        if PHASE != 1:
            tl.store(dSp + (c * HV + i_hv) * K * V + p_s, dS.to(dSp.dtype.element_ty), mask=m_s)
        if PRE:
            de = mm(ke, dS, PREC, DT) + A  # [BT, BV]
        else:
            de = mm(ke, dS, PREC, DT) + mm(tl.trans(A), do, PREC, DT)
        if PHASE != 1:
            store2(dE + i_hv * V, tok, m, HV * V, o_v, m_v, de)
        dS = dS * tl.exp(gl.to(DT))[:, None] + mm(tl.trans(qt), do, PREC_QO, DT) - mm(tl.trans(w), de, PREC, DT)
    if PHASE == 1:  # [B | M^T] of the segment, [K, V + K]
        o_c = tl.where(o_m < 0, o_v, V + o_m)
        m_c = tl.where(o_m < 0, m_v, o_m < K)
        p = MB + ((i_n * NS + i_s) * HV + i_hv) * K * (V + K) + o_k[:, None] * (V + K) + o_c[None, :]
        tl.store(p, dS.to(MB.dtype.element_ty), mask=m_k[:, None] & m_c[None, :])
    elif STORE_INITIAL_STATE_GRADIENT:  # by the first segment
        tl.store(dh0 + s_off + p_u, dS.to(dh0.dtype.element_ty), mask=m_s & (p_s * 0 + i_s == 0))


def chunk_bwd_scan(
    dO: Tensor,
    Mqk: Tensor,
    Qt: Tensor,
    Kend: Tensor,
    W: Tensor,
    Gl: Tensor,
    dht: Tensor | None,
    cu: Tensor,
    prec: str,
    store_dh0: bool = True,
    offsets: Tensor | None = None,
    dsp_dtype: torch.dtype | None = None,
    state_v_first: bool = False,
    slots: SlotRows | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(dE [T, HV, V], dS' [NC, HV, K, V], dh0 [N, HV, K, V] or None)`` in the compute dtype of ``Gl``, ``dS'`` in
    ``dsp_dtype`` when given.

    ``dO [T, HV, V]`` (any float dtype), ``Mqk [T, HV, BT]``, ``Qt, Kend, W [T, HV, K]``, ``Gl [NC, HV, K]`` as from
    the forward's stages; ``dht [N, HV, K, V]`` (None: zero); ``cu`` sanitized flat ``cu_seqlens`` (int64);
    ``offsets`` each sequence's first chunk slot (computed from ``cu`` when not given); ``slots`` the chunk slots'
    rows (:func:`~kda_ops.triton.chunk.slots.slot_map`), which let a split scan form ``Mqk^T dO`` beforehand. With
    ``state_v_first`` ``dht`` and ``dh0`` are ``[N, HV, V, K]`` (``dS'`` keeps ``[K, V]``).

    ``dS'`` is stored once per chunk and read by the dq/dk stage, never carried: the scan's own ``dS`` stays in
    fp32 registers, so a 16-bit ``dsp_dtype`` rounds each stored state once, with no compounding over chunks (the
    forward stores its per-chunk states likewise): the peak memory of forward + backward at B1 T32768 H32 bf16 on
    an H200 5.39 -> 4.85 GB. ``dE`` stays in the compute dtype: it feeds the products through ``Tm``, and stored in
    bf16 it took dv's error at B1 T1000 H32 from 2.43e-3 to 2.92e-3 against float64 (H100).
    """
    T, HV, K = W.shape
    V = dO.shape[2]
    NC = Gl.shape[0]
    N = cu.shape[0] - 1
    dt = Gl.dtype
    dE = dO.new_empty(T, HV, V, dtype=dt)
    dSp = dO.new_empty(NC, HV, K, V, dtype=dsp_dtype or dt)
    dh0 = dO.new_empty(state_shape(N, HV, K, V, state_v_first), dtype=dt) if store_dh0 else None
    poison(dE, dSp, dh0)
    offsets = chunk_offsets(cu) if offsets is None else offsets
    # the forward's rule: at B1 T32768 bf16 on an H200 the reverse scan takes 0.63 ms at H4 (16 segments) and 1.25
    # at H8 (8), against 2.29 and 2.32 unsplit
    nseg = scan_segments(N, HV, T, V, dO.device)
    BV = scan_block_v(V, N * HV, dO.device, nseg)
    args = (contiguous(dO), contiguous(Mqk), contiguous(Qt), contiguous(Kend), contiguous(W), Gl)
    # the split scan's steps (4 warps, two programs per SM) gain more than the pass costs; the plain scan's do not
    # (forward + backward on an H100: B1 T32768 H8 4.67 -> 4.51 ms, H32 14.64 -> 14.70 unsplit)
    pre = slots is not None and nseg > 1
    meta = dict(K=K, V=V, BK=pow2(K), BV=BV, BT=BT, STORE_INITIAL_STATE_GRADIENT=store_dh0, PREC=prec,
                PREC_QO=exact_bf16(prec, Qt, dO), DT=compute_dtype(Gl), STATE_V_FIRST=state_v_first,
                PRE=pre, **launch("scan"))  # fmt: skip
    if pre:
        assert slots is not None
        chunk_bwd_pre_kernel[chunk_grid(slots.start.shape[0], HV)](
            args[0], args[1], dE, slots.start, slots.count, HV, V=V, BT=BT, PREC=prec, DT=meta["DT"],
            **launch("scan_pre", BV=V),
        )  # fmt: skip
    dht_c = None if dht is None else contiguous(dht)
    if nseg == 1:
        chunk_bwd_scan_kernel[(cdiv(V, BV), N * HV)](
            *args, dht_c, dSp, dE, dh0, cu, offsets, None, HV, 1, USE_FINAL_STATE_GRADIENT=dht is not None, PHASE=0,
            **meta,
        )  # fmt: skip
        return dE, dSp, dh0
    # the split reverse scan: the maps of segments 1.. from a zero gradient; the gradient leaving each segment, from
    # the last; each segment's chunks from it
    MB = dO.new_empty(N * (nseg - 1), HV, K, V + K, dtype=dt)
    poison(MB)
    meta.update(launch("scan_split"))
    chunk_bwd_scan_kernel[(cdiv(V, BV) + cdiv(K, BV), N * (nseg - 1) * HV)](
        *args, None, dSp, dE, None, cu, offsets, MB, HV, nseg, USE_FINAL_STATE_GRADIENT=False, PHASE=1,
        **dict(meta, STORE_INITIAL_STATE_GRADIENT=False, STATE_V_FIRST=False),
    )  # fmt: skip
    Sout = segment_states(MB, dht_c, cu, nseg, state_v_first, reverse=True)
    chunk_bwd_scan_kernel[(cdiv(V, BV), N * nseg * HV)](
        *args, Sout, dSp, dE, dh0, cu, offsets, None, HV, nseg, USE_FINAL_STATE_GRADIENT=True, PHASE=2, **meta,
    )  # fmt: skip
    return dE, dSp, dh0


__all__ = ["chunk_bwd_scan"]
