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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import state_dtype
from kda_ops.triton.chunk.precision import Precision
from kda_ops.triton.chunk.tiles import BT, head_factors, scale_rows, state_tile, store2, tile2
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

# No 16-wide tiles: at BV = 16 the scan faults on the H200 (triton 3.6) with an out-of-range shared address in its
# dot, while BV = 32 and 64 run.
BV_CHOICES = (64, 32)
# Programs per SM below which BV halves: one program per SM leaves the scan's latency exposed; 0.8 keeps
# 32 heads x 4 tiles = 128 programs on a 132-SM H200 at BV = 32 (0.845 ms at B1 T32768 H32 bf16, against 1.133 for
# BV = 64 with 64 programs).
MIN_PROGRAMS_PER_SM = 0.8


def block_v_choices(V: int) -> list[int]:
    """The value tiles the scan may use for head dimension ``V`` (largest first)."""
    return [bv for bv in BV_CHOICES if bv <= pow2(V)] or [BV_CHOICES[-1]]


def scan_block_v(V: int, programs: int, device: torch.device) -> int:
    """The value tile of the scan: the largest of :func:`block_v_choices` that keeps enough programs."""
    if forced.scan_block_v is not None:
        return forced.scan_block_v
    choices = block_v_choices(V)
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


@jit_any_length
def chunk_state_kernel(
    W, U, Kend, Gl, h0, final, Hin, E, Nk, cu, chunk_off, HV, T,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, PREC_SCAN: tl.constexpr, DT: tl.constexpr,
    NORMS: tl.constexpr, X_FORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    # one grid axis (the others stop at 65535), value tiles of one head adjacent: they share W and Kend in L2
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_nh = pid // NV
    i_v = pid % NV
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    rows = tl.arange(0, BT)
    o_k, m_k, o_v, m_v, m_s, p_s, s_off = state_tile(i_n, i_hv, i_v, HV, K, V, BK, BV)
    if USE_INITIAL_STATE:
        S = tl.load(h0 + s_off + p_s, mask=m_s, other=0.0).to(DT)
    else:
        S = tl.zeros((BK, BV), dtype=DT)
    n_chunks = tl.cdiv(eos - bos, BT).to(tl.int32)
    # The next chunk's tiles load while this chunk's products run (registers, no compiler pipelining); not two chunks
    # ahead, which takes more registers: the scan at B1 T32768 H32 bf16 on an H200 0.842 ms against 0.988.
    tok = bos + rows
    m = tok < eos
    w, u, ke, gl, nk = scan_tiles(W, U, Kend, Gl, Nk, tok, eos, c0, 0, n_chunks, i_hv, HV, T, o_k, m_k, o_v, m_v, K, V,
                                  BT, DT, NORMS)  # fmt: skip
    for j in range(n_chunks):
        c = c0 + j
        w_n, u_n, ke_n, gl_n, nk_n = scan_tiles(W, U, Kend, Gl, Nk, tok + BT, eos, c0, j + 1, n_chunks, i_hv, HV, T,
                                                o_k, m_k, o_v, m_v, K, V, BT, DT, NORMS)  # fmt: skip
        # the state's store first, U as stored until its use: the scan at B1 T32768 H32 bf16 on an H200 0.886 ->
        # 0.862 ms
        tl.store(Hin + (c * HV + i_hv) * K * V + p_s, S.to(Hin.dtype.element_ty), mask=m_s)
        if X_FORM:  # X = V - diag(nk) Kt S;  S' = exp(Gam_last) S + Kb^T X
            Ec = u.to(DT) - scale_rows(mm(w, S, PREC_SCAN, DT), nk, NORMS)
        else:  # E = U - W S;  S' = exp(Gam_last) S + Kend^T diag(nk) E
            Ec = u.to(DT) - mm(w, S, PREC_SCAN, DT)
        store2(E + i_hv * V, tok, m, HV * V, o_v, m_v, Ec)
        if X_FORM:
            S = S * tl.exp(gl)[:, None] + mm(tl.trans(ke), Ec, PREC_SCAN, DT)
        else:
            S = S * tl.exp(gl)[:, None] + mm(tl.trans(ke), scale_rows(Ec, nk, NORMS), PREC_SCAN, DT)
        tok += BT
        m = tok < eos
        w, u, ke, gl, nk = w_n, u_n, ke_n, gl_n, nk_n
    if STORE_FINAL_STATE:
        tl.store(final + s_off + p_s, S.to(final.dtype.element_ty), mask=m_s)


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
) -> tuple[Tensor, Tensor]:
    """Run the scan over the chunks of every sequence of ``cu`` (sanitized, int64, over the flat token stream).

    ``W, Kend [T, HV, K]``, ``U [T, HV, V]``, ``Gl [NC, HV, K]`` (per chunk slot), ``h0 [N, HV, K, V]`` or None.
    Writes ``final [N, HV, K, V]`` if given. Returns the state entering each chunk slot and the chunks' errors,
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
    """
    T, HV, K = W.shape
    V = U.shape[2]
    NC = Gl.shape[0]
    N = cu.shape[0] - 1
    dt = precision.store or state_dtype(Gl)
    Hin = W.new_empty(NC, HV, K, V, dtype=dt)
    E = W.new_empty(T, HV, V, dtype=dt)
    poison(Hin, E)
    BV = scan_block_v(V, N * HV, W.device)
    offsets = chunk_offsets(cu) if offsets is None else offsets
    _launch_scan(
        (N * HV * cdiv(V, BV),),
        (contiguous(W), contiguous(U), contiguous(Kend), Gl, h0, final, Hin, E,
         None if norms is None else norms[1], cu, offsets, HV, T),
        dict(K=K, V=V, BK=pow2(K), BV=BV, BT=BT, USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=final is not None,
             PREC_SCAN=precision.scan, DT=compute_dtype(Gl), NORMS=norms is not None, X_FORM=x_form,
             **launch("scan"), **pdl(W.device)),
    )  # fmt: skip
    return Hin, E


_launch_scan = Launcher(chunk_state_kernel)

__all__ = ["block_v_choices", "chunk_offsets", "chunk_state", "scan_block_v"]
