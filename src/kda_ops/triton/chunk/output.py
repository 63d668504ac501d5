"""Stage 5: the outputs ``O = Qt S + Mqk E`` of every chunk, from the state ``S`` entering it.

``Qt S`` reads the decayed incoming state; ``Mqk E`` adds the causal contributions of the writes made inside the
chunk (the diagonal included: KDA reads after writing). Parallel over (chunk slot, value tile, value head) items,
reading the states ``Hin`` and errors ``E`` the scan (:mod:`~kda_ops.triton.chunk.scan`) stored. The stage only
moves memory (72 KB in, 16 KB out per item at K = V = 128 in bf16), so where the tiles are 16-bit a program per SM
walks the items with the next ones' loads in flight (``LAUNCH["output"]`` in :mod:`~kda_ops.triton.launch`);
elsewhere a program takes one item.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.triton.chunk.precision import Precision
from kda_ops.triton.chunk.tiles import BT, col_mask, head_factors, scale_rows, store2, tile2
from kda_ops.triton.lang import mm, pdl_enter
from kda_ops.triton.launch import (
    FEW_ITEMS_PER_SM,
    Launcher,
    cdiv,
    compute_dtype,
    contiguous,
    forced,
    jit_any_length,
    launch,
    num_sms,
    pdl,
    persistent_programs,
    poison,
    pow2,
)
from kda_ops.varlen import SlotRows


@triton.jit
def output_tile(qt, S, A, E, nq, PREC: tl.constexpr, DT: tl.constexpr, NORMS: tl.constexpr):
    """``Qt S + Mqk E``: ``qt [BT, BK]``, ``S [BK, BV]``, ``A = Mqk [BT, BT]``, ``E [BT, BV]``; with ``NORMS``,
    ``diag(nq) Qt S + Mqk E`` (``Qt`` stored without the l2norm factors ``nq [BT]`` of its rows)."""
    return scale_rows(mm(qt, S, PREC, DT), nq, NORMS) + mm(A, E, PREC, DT)


@jit_any_length
def chunk_output_kernel(
    Qt, Mqk, Hin, E, o, Nq, slot_start, slot_count, Keep, NC, HV, T,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, DT: tl.constexpr, NORMS: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    KEEP: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    # Items (chunk slot, value tile, value head), the head fastest, taken by the programs in turn: as many programs as
    # items (one each), or fewer whose loop the compiler pipelines over STAGES (the next items' tiles load while
    # this one's products and store run). A slot's heads adjacent read whole [BT, HV, *] row blocks, as
    # chunk_item's order does: the forward at B1 T32768 H32 bf16 on an H100 3.02 ms against 3.05 with the slot
    # fastest. A slot without tokens loads and stores nothing.
    NV: tl.constexpr = (V + BV - 1) // BV
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = col_mask(o_k, K, BK)
    for it in tl.range(tl.program_id(0), NC * NV * HV, tl.num_programs(0), num_stages=STAGES):
        i_hv = it % HV
        i_v = (it // HV) % NV
        i_c = it // (HV * NV)
        count = tl.load(slot_count + i_c).to(tl.int32)
        tok = tl.load(slot_start + i_c).to(tl.int64) + rows
        m = rows < count
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = col_mask(o_v, V, BV)
        qt = tile2(Qt + i_hv * K, tok, m, HV * K, o_k, m_k)
        A = tile2(Mqk + i_hv * BT, tok, m, HV * BT, rows, col_mask(rows, BT, BT))
        Ec = tile2(E + i_hv * V, tok, m, HV * V, o_v, m_v)
        # [BK] conditions: triton 3.9's interpreter rejects a mask of tensor & scalar
        live = m_k & (o_k * 0 + count > 0)
        p_s = Hin + (i_c.to(tl.int64) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        S = tl.load(p_s, mask=live[:, None] & m_v[None, :], other=0.0)
        nq = head_factors(Nq, tok, m, i_hv, T, DT, NORMS)
        out = output_tile(qt, S, A, Ec, nq, PREC, DT, NORMS)
        if KEEP:  # zeros for the slot of a padding sequence (Keep[i_c] == 0), whatever its tokens hold
            out = tl.where(tl.load(Keep + i_c) != 0, out, 0.0)
        store2(o + i_hv * V, tok, m, HV * V, o_v, m_v, out)


def chunk_output(
    Qt: Tensor,
    Mqk: Tensor,
    Hin: Tensor,
    E: Tensor,
    slots: SlotRows,
    precision: Precision,
    out_dtype: torch.dtype,
    out: Tensor | None = None,
    norms: Tensor | None = None,
    keep: Tensor | None = None,
) -> Tensor:
    """``o [T, HV, V]`` in ``out_dtype``: ``Qt [T, HV, K]``, ``Mqk [T, HV, BT]``, ``Hin [NC, HV, K, V]`` (the state
    entering each slot), ``E [T, HV, V]`` (the resolved errors). ``out``: a contiguous ``[T, HV, V]`` tensor of
    ``out_dtype`` to write into (the op's output, saving a copy), else a new one. ``norms [2, HV, T]``: the l2norm
    factors of ``Qt``'s rows (``norms[0]``) when it was stored without them. ``keep [NC]`` (int32): a slot whose
    entry is 0 gets zero outputs (the rows of a padding sequence of the serving ops)."""
    T, HV, K = Qt.shape
    V = E.shape[2]
    NC = slots.start.shape[0]
    o = E.new_empty(T, HV, V, dtype=out_dtype) if out is None else out
    assert o.shape == (T, HV, V) and o.dtype == out_dtype and o.is_contiguous(), "chunk_output: bad out"
    poison(o)
    # 128-wide value tiles (LAUNCH) where measured: 16-bit states, K <= 128. Elsewhere 64: fp32 tiles of K = 256
    # would not fit the shared memory, and at K = 256 in bf16 one program would take 120 KB of it.
    # Few items (a short prompt: FEW_ITEMS_PER_SM) leave a program per SM little to pipeline: a program per item at
    # value tile 64 then.
    per_item = forced.output_per_item
    few = o.is_cuda and (NC * HV < FEW_ITEMS_PER_SM * num_sms(o.device) if per_item is None else per_item)
    wide = Hin.element_size() == 2 and K <= 128 and not few
    cfg = launch("output", BV=V if wide else min(V, 64))
    items = NC * cdiv(V, cfg["BV"]) * HV
    if wide or not o.is_cuda:  # programs walking the items: one per SM, its loop pipelined over LAUNCH's stages
        programs = min(items, persistent_programs(o.device))
    else:  # a program per item, one stage: fp32 tiles of K = 256 take the shared memory of one stage
        programs, cfg = items, dict(cfg, num_stages=1)
    _launch_output(
        (programs,),
        (contiguous(Qt), contiguous(Mqk), contiguous(Hin), contiguous(E), o, None if norms is None else norms[0],
         slots.start, slots.count, keep, NC, HV, T),
        dict(K=K, V=V, BK=pow2(K), BT=BT, PREC=precision.output, DT=compute_dtype(Hin), NORMS=norms is not None,
             STAGES=cfg["num_stages"], KEEP=keep is not None, **cfg, **pdl(o.device)),
    )  # fmt: skip
    return o


_launch_output = Launcher(chunk_output_kernel)

__all__ = ["chunk_output", "output_tile"]
