"""The chunk map of the Triton drivers: a dense batch's in one launch, a ``cu_seqlens`` one by
:func:`kda_ops.varlen.chunk_map`.

A dense batch ``[B, T]`` has a map that depends on ``B`` and ``T`` alone (``varlen._dense_map``'s formulas), which
:func:`kda_ops.varlen.chunk_map` builds in 11 torch ops, each a launch on an eager call's path (87-91 µs of host time
for the map of a B1 T1024 call on the H200's host). Here one kernel fills one int64 buffer (one allocation, one
launch) and the map's four tensors are views of it. It is built per call: a map cached across calls and made
during a ``reduce-overhead`` warm-up would live in the CUDA-graph tree's memory pool, which the tree reclaims.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kda_ops.triton.chunk.tiles import BT
from kda_ops.triton.lang import pdl_enter
from kda_ops.triton.launch import Launcher, cdiv, jit_any_length, pdl
from kda_ops.varlen import ChunkMap, chunk_map, num_chunk_slots

BLOCK = 1024


@jit_any_length
def dense_map_kernel(buf, B, T, NC, nch, C: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Entry ``i`` of each part of ``buf = [start (NC) | count (NC) | cu (B + 1) | offset (B)]``: slot ``i`` is
    chunk ``j = i - seq * nch`` of sequence ``seq = min(i // nch, B - 1)`` (the last sequence's trailing slots have
    ``j >= nch``: count 0)."""
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    seq = tl.minimum(i // nch, B - 1)
    j = i - seq * nch
    slot = i < NC
    tl.store(buf + i, seq * T + j * C, mask=slot)
    tl.store(buf + NC + i, tl.minimum(tl.maximum(T - j * C, 0), C), mask=slot)
    tl.store(buf + 2 * NC + i, i * T, mask=i <= B)
    tl.store(buf + 2 * NC + B + 1 + i, i * nch, mask=i < B)


def slot_map(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device) -> ChunkMap:
    """The chunk map (chunks of :data:`~kda_ops.triton.chunk.tiles.BT` tokens) of a batch ``[B, T]`` or of
    ``cu_seqlens`` over ``B * T`` tokens: equal to :func:`kda_ops.varlen.chunk_map` (``tests/test_varlen.py``)."""
    if cu_seqlens is not None or B * T == 0:
        return chunk_map(cu_seqlens, B, T, BT, device)
    nch = cdiv(T, BT)
    NC = num_chunk_slots(B * T, B, BT)
    buf = torch.empty(2 * NC + 2 * B + 1, dtype=torch.int64, device=device)
    meta = {"C": BT, "BLOCK": BLOCK, "num_warps": 4, **pdl(device)}
    _launch_map((cdiv(max(NC, B + 1), BLOCK),), (buf, B, T, NC, nch), meta)
    start, count, cu, offset = torch.split(buf, [NC, NC, B + 1, B])
    return ChunkMap(cu, start, count, offset)


_launch_map = Launcher(dense_map_kernel)

__all__ = ["dense_map_kernel", "slot_map"]
