"""Stage 4: the inter-chunk state scan, the only sequential part of the chunkwise forward.

One program per (sequence, value head, value tile) holds the state tile ``S [K, BV]`` in registers (fp32) and walks
the sequence's chunks in order::

    E  = U - W S                                   resolved errors of the chunk       [BT, BV]
    S' = diag(exp(Gam_last)) S + Kend^T E          the state entering the next chunk

or, in the forward's X form (``E = Tb X``, with ``Tb`` folded into ``Kb = Tb^T Kend`` by the prepare kernel)::

    X  = V - Kt S,   S' = diag(exp(Gam_last)) S + Kb^T X

The sequence's bounds come from ``cu_seqlens`` on the device and its chunks are slots ``chunk_off[n] ..`` of the
chunk-slot map, so the grid is ``N * HV * cdiv(V, BV)`` programs whatever the lengths: one CUDA graph serves every
``cu_seqlens`` of one size. The scan stores the state entering each chunk (``Hin [NC, HV, K, V]``) and ``E`` for
the output stage (:mod:`~kda_ops.triton.chunk.output`) and the backward.

The outputs are a stage of their own, parallel over chunks, although computing them here would keep ``Hin`` out of
memory: on the scan's sequential path they cost more than they save (at B1 T32768 H32 bf16 on an H200, 1.51 ms
fused against 0.84 + 0.49 for the scan and the output stage apart).

Value tiles: the programs are independent across ``V``, so ``BV`` trades parallelism (``N * HV * V / BV`` programs
for the machine's SMs) against re-reading ``W`` and ``Kend`` once per tile (from L2).

The split scan (``docs/math.md``, "Segments: the split scan"): where even the smallest tile leaves SMs idle (few
sequences and heads, long sequences), each sequence is cut into :func:`scan_segments` segments, a static count from
``N``, ``HV``, ``T`` and the SM count, their chunk ranges found on the device from ``cu_seqlens``. The same kernel
runs the segments' maps from a zero state (``PHASE`` 1: ``[B | M]``, over the value and the identity's columns),
:func:`segment_states_kernel` combines them in order, and the kernel finishes each segment from its true initial
state (``PHASE`` 2); ``PHASE`` 0 is the plain scan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import state_dtype
from kda_ops.triton.chunk.precision import Precision
from kda_ops.triton.chunk.tiles import BT, head_factors, scale_rows, state_offsets, state_tile, store2, tile2
from kda_ops.triton.lang import mm, pdl_enter
from kda_ops.triton.launch import (
    Launcher,
    cdiv,
    compute_dtype,
    contiguous,
    forced,
    jit_any_length,
    launch,
    num_sms,
    pdl,
    poison,
    pow2,
)
from kda_ops.varlen import sequence_chunks

# No 16-wide tiles: at BV = 16 with 4 warps (two programs per SM) the forward at B1 T32768 H32 bf16 took 3.247 ms on
# an H100, against 3.098 at BV = 32 with 8 warps; each program still reads the chunk's whole W and Kend tiles.
BV_CHOICES = (64, 32)
# Programs per SM below which BV halves: one program per SM leaves the scan's latency exposed; 0.8 keeps
# 32 heads x 4 tiles = 128 programs on a 132-SM H200 at BV = 32 (0.845 ms at B1 T32768 H32 bf16, against 1.133 for
# BV = 64 with 64 programs).
MIN_PROGRAMS_PER_SM = 0.8


def block_v_choices(V: int) -> list[int]:
    """The value tiles the scan may use for head dimension ``V`` (largest first)."""
    return [bv for bv in BV_CHOICES if bv <= pow2(V)] or [BV_CHOICES[-1]]


# The split scan (sequence parallelism inside the card) when the plain scan's programs leave SMs idle: each sequence
# in segments of at least MIN_SEGMENT_CHUNKS chunks, enough of them for SEGMENT_PROGRAMS_PER_SM programs per SM in
# the finishing pass: two, as two 4-warp programs share an SM (the forward at B1 T32768 bf16 on an H200: H4 0.607 ms
# at 16 segments, H8 1.018 at 8, against 1.239 and 1.455 unsplit).
MIN_SEGMENT_CHUNKS = 16
SEGMENT_PROGRAMS_PER_SM = 2.0


def scan_segments(N: int, HV: int, T: int, V: int, device: torch.device) -> int:
    """Segments per sequence of the scan over ``N`` sequences of ``T`` tokens in all (``HV`` value heads of ``V``
    columns): 1 (the plain scan) when its programs fill the machine, else up to what fills it at the smallest value
    tile, each segment at least :data:`MIN_SEGMENT_CHUNKS` chunks of the average sequence, rounded down to a power
    of two."""
    if forced.scan_segments is not None:
        return forced.scan_segments
    sms = num_sms(device)
    programs = N * HV * cdiv(V, block_v_choices(V)[-1])
    if programs == 0 or programs >= MIN_PROGRAMS_PER_SM * sms:
        return 1
    n = min(cdiv(int(SEGMENT_PROGRAMS_PER_SM * sms), programs), T // (N * BT * MIN_SEGMENT_CHUNKS))
    # a power of two: 16 segments of 32 chunks at B1 T32768 H4, not 17 of 31 and a short one
    return 1 << (n.bit_length() - 1) if n > 1 else 1


# The segment combine holds a whole map M [K, K] in fp32 registers (and the next one, loading) up to this K, its
# product on the tensor cores in 3xTF32 (202 registers, no spill at K = V = 128, BV = 16, 8 warps; the exact fp32
# product of Triton spills 1.7 KB per thread there): at B1 T32768 bf16 on an H200 the combine takes 0.075 ms at H4
# (16 segments) and 0.090 at H8 (8), against 0.164 and 0.179 in exact fp32 key blocks, which serve beyond it.
COMBINE_ONE_DOT_MAX_K = 128


def scan_block_v(V: int, programs: int, device: torch.device, segments: int = 1) -> int:
    """The value tile of the scan: the largest of :func:`block_v_choices` that keeps enough programs; the smallest
    for a scan split into ``segments > 1`` (:func:`scan_segments` counts on it)."""
    if forced.scan_block_v is not None:
        return forced.scan_block_v
    choices = block_v_choices(V)
    if segments > 1:
        return choices[-1]
    for bv in choices:
        if cdiv(V, bv) * programs >= MIN_PROGRAMS_PER_SM * num_sms(device):
            return bv
    return choices[-1]


# The launch is fixed (``launch.LAUNCH["scan"]``): no spills at K = V = 128, BV = 32 (ptxas, sm_90), and one stage
# only: with two stages of cp.async prefetch, triton 3.6 on the H200 faults with "out-of-range shared address" in
# the scan's dot at K = 128 (compute-sanitizer memcheck).


@triton.jit
def scan_tiles(W, U, Kend, Gl, Nk, tok, eos, c0, j, n_chunks, i_hv, HV, T, o_k, m_k, o_v, m_v, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr, NORMS: tl.constexpr):
    """The tiles the scan reads for chunk ``j`` of the sequence (rows ``tok``): ``W, Kend [BT, BK]`` and
    ``U [BT, BV]`` as stored, ``Gam_last [BK]`` in ``DT`` and the l2norm factors of the rows (``NORMS``: ``Nk``
    holds ``[HV, T]``; else 1.0). Zeros past the sequence's end."""
    m = tok < eos
    w = tile2(W + i_hv * K, tok, m, HV * K, o_k, m_k)
    u = tile2(U + i_hv * V, tok, m, HV * V, o_v, m_v)
    ke = tile2(Kend + i_hv * K, tok, m, HV * K, o_k, m_k)
    # chunk-count conditions as [BK] tensors: triton 3.9's interpreter rejects a mask of tensor & scalar
    gl = tl.load(Gl + ((c0 + j) * HV + i_hv) * K + o_k, mask=m_k & (o_k * 0 + j < n_chunks), other=0.0).to(DT)
    # NORMS: the l2norm factors of the rows that were stored without them (the prepare kernel folds the l2norm into
    # its key loop): those of Kt (in W) in the X form, of Kend otherwise
    nk = head_factors(Nk, tok, m, i_hv, T, DT, NORMS)
    return w, u, ke, gl, nk


@triton.jit
def user_state(Slots, NSLOT, i_n, i_hv, HV, K: tl.constexpr, V: tl.constexpr, USE_SLOTS: tl.constexpr):
    """Where sequence ``i_n``'s initial and final state lie in the user's ``[N, HV, ...]`` tensor, or with
    ``USE_SLOTS`` in a pool of ``NSLOT`` states at slot ``Slots[i_n]``; and 1 where it is read and written, 0 for a
    padding slot (outside ``[0, NSLOT)``)."""
    if USE_SLOTS:
        slot = tl.load(Slots + i_n).to(tl.int64)
        ok = ((slot >= 0) & (slot < NSLOT)).to(tl.int32)
        slot = tl.where(ok != 0, slot, 0)
    else:
        slot = i_n.to(tl.int64)
        ok = 1
    return (slot * HV + i_hv) * K * V, ok


@jit_any_length
def chunk_state_kernel(
    W, U, Kend, Gl, h0, final, Hin, E, Nk, cu, chunk_off, MB, Slots, NSLOT, Ckpt, NCKPT, CKPT_EVERY, HV, T, NSEG,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, PREC_SCAN: tl.constexpr, DT: tl.constexpr,
    NORMS: tl.constexpr, X_FORM: tl.constexpr, PHASE: tl.constexpr, PDL: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    USE_SLOTS: tl.constexpr = False, USE_CKPT: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    # one grid axis (the others stop at 65535), value tiles of one head adjacent: they share W and Kend in L2
    NV: tl.constexpr = (V + BV - 1) // BV
    # PHASE 1 also runs the identity's columns (the segment's map M, over K) after the value tiles (its B)
    NTILE: tl.constexpr = NV + (K + BV - 1) // BV if PHASE == 1 else NV
    if PHASE == 1:
        NS = NSEG - 1
    else:
        NS = NSEG
    pid = tl.program_id(0)
    i_v = pid % NTILE
    i_nh = pid // NTILE
    i_hv = i_nh % HV
    i_ns = i_nh // HV
    i_s = i_ns % NS
    i_n = i_ns // NS
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    rows = tl.arange(0, BT)
    o_k, m_k, o_v, m_v, m_s, p_s, s_off = state_tile(i_n, i_hv, i_v, HV, K, V, BK, BV)
    p_u = state_offsets(o_k, o_v, K, V, STATE_V_FIRST)  # the user's h0 and final state; Hin and Sin use p_s
    u_off, u_ok = user_state(Slots, NSLOT, i_n, i_hv, HV, K, V, USE_SLOTS)
    m_u_s = m_s & (p_s * 0 + u_ok != 0)  # a padding slot is neither read nor written
    n_chunks = tl.cdiv(eos - bos, BT).to(tl.int32)
    seq_len = eos - bos
    j0 = n_chunks * 0  # the first chunk of the program's run within the sequence
    if PHASE != 0:  # segment i_s: chunks [j0, j0 + L) of the sequence's n_chunks
        L = tl.cdiv(n_chunks, NSEG)
        j0 = tl.minimum(i_s * L, n_chunks)
        n_chunks = tl.minimum(L, n_chunks - j0)
        bos += j0 * BT
        c0 += j0
    if PHASE == 1:
        # from a zero state: the value tiles give the segment's B, the identity's columns o_m its M
        o_m = (i_v - NV) * BV + tl.arange(0, BV)
        # (o_m < 0 on the value tiles; vector conditions: triton 3.9's interpreter rejects a mask of tensor & scalar)
        S = (o_k[:, None] == o_m[None, :]).to(DT)
        m_u = m_v & (o_m < 0)
    elif PHASE == 2:  # from the segment's true initial state, combined by segment_states_kernel
        S = tl.load(h0 + ((i_n * NSEG + i_s) * HV + i_hv) * K * V + p_s, mask=m_s, other=0.0).to(DT)
        m_u = m_v
    else:
        if USE_INITIAL_STATE:
            S = tl.load(h0 + u_off + p_u, mask=m_u_s, other=0.0).to(DT)
        else:
            S = tl.zeros((BK, BV), dtype=DT)
        m_u = m_v
    # The next chunk's tiles load while this chunk's products run (registers, no compiler pipelining); not two chunks
    # ahead, which takes more registers: the scan at B1 T32768 H32 bf16 on an H200 0.842 ms against 0.988.
    tok = bos + rows
    m = tok < eos
    w, u, ke, gl, nk = scan_tiles(W, U, Kend, Gl, Nk, tok, eos, c0, 0, n_chunks, i_hv, HV, T, o_k, m_k, o_v, m_u, K, V,
                                  BT, DT, NORMS)  # fmt: skip
    for j in range(n_chunks):
        c = c0 + j
        w_n, u_n, ke_n, gl_n, nk_n = scan_tiles(W, U, Kend, Gl, Nk, tok + BT, eos, c0, j + 1, n_chunks, i_hv, HV, T,
                                                o_k, m_k, o_v, m_u, K, V, BT, DT, NORMS)  # fmt: skip
        # the state's store first, U as stored until its use: the scan at B1 T32768 H32 bf16 on an H200 0.886 ->
        # 0.862 ms
        if PHASE != 1:
            tl.store(Hin + (c * HV + i_hv) * K * V + p_s, S.to(Hin.dtype.element_ty), mask=m_s)
        if X_FORM:  # X = V - diag(nk) Kt S;  S' = exp(Gam_last) S + Kb^T X
            Ec = u.to(DT) - scale_rows(mm(w, S, PREC_SCAN, DT), nk, NORMS)
        else:  # E = U - W S;  S' = exp(Gam_last) S + Kend^T diag(nk) E
            Ec = u.to(DT) - mm(w, S, PREC_SCAN, DT)
        if PHASE != 1:
            store2(E + i_hv * V, tok, m, HV * V, o_v, m_v, Ec)
        if X_FORM:
            S = S * tl.exp(gl)[:, None] + mm(tl.trans(ke), Ec, PREC_SCAN, DT)
        else:
            S = S * tl.exp(gl)[:, None] + mm(tl.trans(ke), scale_rows(Ec, nk, NORMS), PREC_SCAN, DT)
        if USE_CKPT and PHASE != 1:  # the state after every CKPT_EVERY tokens into its slot Ckpt[i_n, m]
            done = (j0 + j + 1).to(tl.int64) * BT
            ck_m = done // CKPT_EVERY - 1
            hit = (done <= seq_len) & (done % CKPT_EVERY == 0) & (ck_m < NCKPT)
            ck = tl.load(Ckpt + i_n * NCKPT + tl.where(hit, ck_m, 0), mask=hit, other=-1).to(tl.int64)
            ck_ok = (hit & (ck >= 0) & (ck < NSLOT) & (u_ok != 0)).to(tl.int32)  # not for a padding sequence
            tl.store(final + (tl.where(ck_ok != 0, ck, 0) * HV + i_hv) * K * V + p_u, S.to(final.dtype.element_ty),
                     mask=m_s & (p_s * 0 + ck_ok != 0))  # fmt: skip
        tok += BT
        m = tok < eos
        w, u, ke, gl, nk = w_n, u_n, ke_n, gl_n, nk_n
    if PHASE == 1:  # [B | M] of the segment, [K, V + K]
        o_c = tl.where(o_m < 0, o_v, V + o_m)
        m_c = tl.where(o_m < 0, m_v, o_m < K)
        p = MB + ((i_n * NS + i_s) * HV + i_hv) * K * (V + K) + o_k[:, None] * (V + K) + o_c[None, :]
        tl.store(p, S.to(MB.dtype.element_ty), mask=m_k[:, None] & m_c[None, :])
    elif STORE_FINAL_STATE:  # by the last segment
        tl.store(final + u_off + p_u, S.to(final.dtype.element_ty), mask=m_u_s & (p_s * 0 + i_s == NS - 1))


@jit_any_length
def segment_states_kernel(
    MB, h0, Sin, Slots, NSLOT, cu, HV, NSEG, BT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BKC: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
    PDL: tl.constexpr, STATE_V_FIRST: tl.constexpr, REVERSE: tl.constexpr = False, USE_SLOTS: tl.constexpr = False,
):  # fmt: skip
    """The state entering each segment, in order: ``S_in[0] = h0``, ``S_in[s + 1] = M[s] S_in[s] + B[s]`` (one
    program per sequence, value head and value tile). ``REVERSE`` (the backward's reverse scan): the state gradient
    leaving each segment, from the last: ``S[NSEG - 1] = h0`` (``dht``), ``S[s - 1] = M S[s] + B`` with the map of
    segment ``s`` at ``MB[s - 1]``. ``Sin`` keeps ``[K, V]`` whatever the layout of ``h0``.

    ``M S`` is one product ``[BK, BK] x [BK, BV]`` with the state in registers and the next map loaded while it runs
    (the maps do not depend on the states) when ``BKC == BK``; else in ``BKC``-wide key blocks, ``S`` read back from
    ``Sin`` (``M`` in fp32 then exceeds the registers). The map of an empty segment (``M = I``, ``B = 0``: the
    sequence of ``cu`` has fewer chunks than segments) is skipped, so its state passes on bit for bit whatever
    ``PREC``."""
    pdl_enter(PDL)
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_hv = (pid // NV) % HV
    i_n = pid // NV // HV
    o_k, m_k, o_v, m_v, m_s, p_s, s_off = state_tile(i_n, i_hv, i_v, HV, K, V, BK, BV)
    if USE_INITIAL_STATE:  # the user's state, or its pool slot (a padding slot: zero)
        u_off, u_ok = user_state(Slots, NSLOT, i_n, i_hv, HV, K, V, USE_SLOTS)
        S = tl.load(h0 + u_off + state_offsets(o_k, o_v, K, V, STATE_V_FIRST), mask=m_s & (p_s * 0 + u_ok != 0),
                    other=0.0).to(DT)  # fmt: skip
    else:
        S = tl.zeros((BK, BV), dtype=DT)
    maps = MB + (i_n * (NSEG - 1) * HV + i_hv) * K * (V + K)  # map j at maps + j * HV * K * (V + K)
    # the segments' chunk counts as the scan's passes cut them: segment i_s holds chunks [i_s * L, (i_s + 1) * L)
    n_chunks = tl.cdiv(tl.load(cu + i_n + 1) - tl.load(cu + i_n), BT).to(tl.int32)
    L = tl.cdiv(n_chunks, NSEG)
    p_b = o_k[:, None] * (V + K) + o_v[None, :]
    if BKC == BK:
        p_m = o_k[:, None] * (V + K) + V + o_k[None, :]
        m_m = m_k[:, None] & m_k[None, :]
        # the first map (none when NSEG == 1: vector conditions, as the interpreter rejects tensor & scalar)
        j = tl.where(REVERSE, NSEG - 2, 0).to(tl.int64) * HV * K * (V + K)
        Mt = tl.load(maps + j + p_m, mask=m_m & (p_m * 0 + NSEG > 1), other=0.0).to(DT)
        Bt = tl.load(maps + j + p_b, mask=m_s & (p_s * 0 + NSEG > 1), other=0.0).to(DT)
    o_b = tl.arange(0, BKC)
    for s in range(NSEG):
        if REVERSE:  # the state at slot st, then the map at mi
            st = NSEG - 1 - s
            mi = NSEG - 2 - s
        else:
            st = s
            mi = s
        tl.store(Sin + ((i_n * NSEG + st) * HV + i_hv) * K * V + p_s, S.to(Sin.dtype.element_ty), mask=m_s)
        if s < NSEG - 1:
            if BKC == BK:
                # the next map (this one again after the last) while this product runs
                jn = tl.where(REVERSE, tl.maximum(mi - 1, 0), tl.minimum(mi + 1, NSEG - 2)).to(tl.int64)
                Mn = tl.load(maps + jn * HV * K * (V + K) + p_m, mask=m_m, other=0.0).to(DT)
                Bn = tl.load(maps + jn * HV * K * (V + K) + p_b, mask=m_s, other=0.0).to(DT)
                if REVERSE:  # the map at mi is of segment mi + 1 (of segment mi in order)
                    seg = mi + 1
                else:
                    seg = mi
                S = tl.where(seg * L < n_chunks, Bt + mm(Mt, S, PREC, DT), S)
                Mt, Bt = Mn, Bn
            else:
                mb = maps + mi.to(tl.int64) * HV * K * (V + K)
                S = tl.load(mb + p_b, mask=m_s, other=0.0).to(DT)
                # the state just stored, visible to every thread of the program
                tl.debug_barrier()
                sin = Sin + ((i_n * NSEG + st) * HV + i_hv) * K * V
                for kb in range(0, K, BKC):
                    m_c = (kb + o_b) < K
                    Mb = tl.load(mb + o_k[:, None] * (V + K) + V + kb + o_b[None, :],
                                 mask=m_k[:, None] & m_c[None, :], other=0.0).to(DT)  # fmt: skip
                    Sb = tl.load(sin + (kb + o_b)[:, None] * V + o_v[None, :], mask=m_c[:, None] & m_v[None, :],
                                 other=0.0).to(DT)  # fmt: skip
                    S += mm(Mb, Sb, PREC, DT)


def chunk_offsets(cu: Tensor) -> Tensor:
    """First chunk slot of each sequence, ``[N]`` int64 (``kda_ops.varlen.chunk_map(...).offset`` when the map is at
    hand)."""
    chunks, ends = sequence_chunks(cu, BT)
    return ends - chunks


def chunk_state(
    W: Tensor,
    U: Tensor,
    Kend: Tensor,
    Gl: Tensor,
    h0: Tensor | None,
    cu: Tensor,
    precision: Precision,
    *,
    final: Tensor | None = None,
    offsets: Tensor | None = None,
    norms: Tensor | None = None,
    x_form: bool = False,
    state_v_first: bool = False,
    state_indices: Tensor | None = None,
    checkpoints: tuple[Tensor, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the scan over the chunks of every sequence of ``cu`` (sanitized, int64, over the flat token stream).

    ``W, Kend [T, HV, K]``, ``U [T, HV, V]``, ``Gl [NC, HV, K]`` (per chunk slot), ``h0 [N, HV, K, V]`` or None.
    Writes ``final [N, HV, K, V]`` if given. With ``state_v_first``, ``h0`` and ``final`` are ``[N, HV, V, K]``
    (the chunk buffers keep ``[K, V]``). Returns the state entering each chunk slot and the chunks' errors,
    ``(Hin [NC, HV, K, V], E [T, HV, V])``, in ``precision.store`` (half the traffic of the compute dtype for the
    output stage and the backward, which reads them twice). ``offsets``: each sequence's first chunk slot
    (:func:`chunk_offsets` of ``cu`` when not given).
    ``norms [2, HV, T]``: the l2norm factors of q's and k's rows when the factors were stored without them
    (:func:`~kda_ops.triton.chunk.prepare.chunk_prepare`); the scan reads ``norms[1]``, k's.

    ``x_form`` (the factors of :func:`~kda_ops.triton.chunk.prepare.chunk_prepare`; without it those of
    :func:`~kda_ops.triton.chunk.prepare.chunk_prepare_recompute`): ``W`` holds ``Kt``, ``U`` the values ``v``,
    ``Kend`` holds ``Kb = Tb^T Kend``; the scan carries ``X = V - Kt S`` (``norms[1]`` applied to the rows of
    ``Kt S``) and ``S' = exp(Gam_last) S + Kb^T X``, and returns ``X`` where it returns ``E`` otherwise
    (``E = Tb X``).

    ``state_indices [N]``: ``h0`` and ``final`` are one pool ``[S, HV, ...]``; sequence ``n`` starts from slot
    ``state_indices[n]`` and its final state is written back there (a negative slot: from zero, not written).
    ``checkpoints = (idx [N, C], every)`` (with ``state_indices``; ``every`` a multiple of the chunk size): the state
    after ``(m + 1) * every`` tokens of sequence ``n`` also goes to pool slot ``idx[n, m]`` (-1 or past the
    sequence's end: not written).
    """
    T, HV, K = W.shape
    V = U.shape[2]
    NC = Gl.shape[0]
    N = cu.shape[0] - 1
    dt = precision.store or state_dtype(Gl)
    Hin = W.new_empty(NC, HV, K, V, dtype=dt)
    E = W.new_empty(T, HV, V, dtype=dt)
    poison(Hin, E)
    offsets = chunk_offsets(cu) if offsets is None else offsets
    nseg = scan_segments(N, HV, T, V, W.device)
    BV = scan_block_v(V, N * HV, W.device, nseg)
    DT = compute_dtype(Gl)
    args = (contiguous(W), contiguous(U), contiguous(Kend), Gl)
    rest = (None if norms is None else norms[1], cu, offsets)
    slots = None if state_indices is None else contiguous(state_indices)
    nslot = 0 if slots is None or h0 is None else h0.shape[0]
    ckpt, nckpt, every = (None, 0, 0) if checkpoints is None else (contiguous(checkpoints[0]),
                                                                    checkpoints[0].shape[1], checkpoints[1])
    meta = dict(K=K, V=V, BK=pow2(K), BV=BV, BT=BT, STORE_FINAL_STATE=final is not None, PREC_SCAN=precision.scan,
                DT=DT, NORMS=norms is not None, X_FORM=x_form, STATE_V_FIRST=state_v_first,
                USE_SLOTS=slots is not None, USE_CKPT=ckpt is not None, **launch("scan"), **pdl(W.device))  # fmt: skip
    if nseg == 1:
        _launch_scan(
            (N * HV * cdiv(V, BV),),
            (*args, h0, final, Hin, E, *rest, None, slots, nslot, ckpt, nckpt, every, HV, T, 1),
            dict(meta, USE_INITIAL_STATE=h0 is not None, PHASE=0),
        )
        return Hin, E
    # the split scan: each segment's map (M, B) from a zero state; the state entering each segment, in order; each
    # segment's chunks from that state
    MB = W.new_empty(N * (nseg - 1), HV, K, V + K, dtype=state_dtype(Gl))
    poison(MB)
    meta.update(launch("scan_split"))
    _launch_scan(
        (N * (nseg - 1) * HV * (cdiv(V, BV) + cdiv(K, BV)),),
        (*args, None, None, Hin, E, *rest, MB, None, 0, None, 0, 0, HV, T, nseg),
        # no user state in PHASE 1: the K-first kernel serves both layouts
        dict(meta, USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, PHASE=1, STATE_V_FIRST=False, USE_SLOTS=False,
             USE_CKPT=False),
    )
    Sin = segment_states(MB, h0, cu, nseg, state_v_first, state_indices=slots)
    _launch_scan(
        (N * nseg * HV * cdiv(V, BV),),
        (*args, Sin, final, Hin, E, *rest, None, slots, nslot, ckpt, nckpt, every, HV, T, nseg),
        dict(meta, USE_INITIAL_STATE=True, PHASE=2),
    )
    return Hin, E


def segment_states(
    MB: Tensor,
    h0: Tensor | None,
    cu: Tensor,
    nseg: int,
    state_v_first: bool,
    reverse: bool = False,
    state_indices: Tensor | None = None,
) -> Tensor:
    """The state at each segment's boundary, ``[N * nseg, HV, K, V]`` (``[K, V]`` whatever the user's layout), from
    the segments' maps ``MB [N * (nseg - 1), HV, K, V + K]`` (``[B | M]``) of the ``N`` sequences of ``cu``
    (sanitized, int64) and ``h0 [N, HV, K, V]`` (None: zero; a pool read at ``state_indices [N]`` when given):
    entering each segment, or with ``reverse`` the gradient leaving each (:func:`segment_states_kernel`)."""
    N = cu.shape[0] - 1
    _, HV, K, VK = MB.shape
    V = VK - K
    S = MB.new_empty(N * nseg, HV, K, V)
    poison(S)
    cfg = launch("segments", BV=V)
    BK = pow2(K)
    one_dot = BK <= COMBINE_ONE_DOT_MAX_K and MB.dtype == torch.float32  # fp64: exact products in key blocks
    _launch_segments(
        (N * HV * cdiv(V, cfg["BV"]),),
        (MB, h0, S, state_indices, 0 if h0 is None else h0.shape[0], cu, HV, nseg),
        dict(cfg, BT=BT, K=K, V=V, BK=BK, BKC=BK if one_dot else 32, USE_INITIAL_STATE=h0 is not None,
             PREC="tf32x3" if one_dot else "ieee", DT=compute_dtype(MB), **pdl(MB.device),
             STATE_V_FIRST=state_v_first, REVERSE=reverse, USE_SLOTS=state_indices is not None),
    )  # fmt: skip
    return S


_launch_scan = Launcher(chunk_state_kernel)
_launch_segments = Launcher(segment_states_kernel)

__all__ = ["block_v_choices", "chunk_offsets", "chunk_state", "scan_block_v", "scan_segments", "segment_states"]
