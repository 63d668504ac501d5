"""Sequence and chunk bookkeeping built on the device, without reading values on the host.

Every schedule sees a batch as a flat stream of ``T`` tokens split into ``N`` sequences by ``cu_seqlens``
(a dense batch ``[B, T]`` is ``N = B`` sequences of ``T`` tokens each). The chunk map has a *static* size,
``cdiv(T, C) + N`` slots, which bounds the number of chunks for any split; slots past the last chunk are empty.
Only ``T``, ``N`` and ``C`` shape the result, so one compiled graph or captured CUDA graph serves every
``cu_seqlens`` of the same length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


def dense_cu_seqlens(B: int, T: int, device: torch.device) -> Tensor:
    """``cu_seqlens`` of a dense batch: ``[0, T, 2T, ..., BT]`` (int64)."""
    return torch.arange(B + 1, device=device, dtype=torch.int64) * T


def sanitize_cu_seqlens(cu_seqlens: Tensor, T: int) -> Tensor:
    """Clamp into ``[0, T]`` and make non-decreasing, so values that break the contract cannot index out of bounds."""
    cu = cu_seqlens.to(torch.int64).clamp(0, T)
    return torch.cummax(cu, dim=0).values


def flat_cu_seqlens(cu_seqlens: Tensor | None, B: int, T: int, device: torch.device) -> Tensor:
    """The flat-stream ``cu_seqlens`` over ``B * T`` tokens: the given one, sanitized, or the dense batch's."""
    if cu_seqlens is None:
        return dense_cu_seqlens(B, T, device)
    return sanitize_cu_seqlens(cu_seqlens, B * T)


def num_chunk_slots(T: int, N: int, C: int) -> int:
    """The static number of chunk slots: ``cdiv(T, C) + N`` bounds ``sum_n cdiv(len_n, C)``."""
    return (T + C - 1) // C + N


def chunk_states_shape(B: int, T: int, N: int, packed: bool, C: int) -> tuple[int, int]:
    """The leading dimensions of the per-chunk states of ``chunk_kda(..., return_intermediate_states=True)``: a dense
    batch ``(B, cdiv(T, C))``; packed sequences ``(1, cdiv(B*T, C) + N)``, the static chunk-slot count (sequence
    ``n``'s chunks at its chunk offset ``sum_{m<n} cdiv(len_m, C)``, the slots past the last chunk zero)."""
    if packed:
        return 1, num_chunk_slots(B * T, N, C)
    return B, (T + C - 1) // C


def chunk_states(
    Hin: Tensor, count: Tensor, B: int, T: int, packed: bool, C: int, dtype: torch.dtype, state_v_first: bool = False
) -> Tensor:
    """The state entering each chunk, ``[*chunk_states_shape, HV, K, V]`` in ``dtype``, from ``Hin [NC, HV, K, V]``
    per chunk slot (``count``: the tokens of each slot). With ``state_v_first`` ``[..., HV, V, K]``: a transposed
    copy of ``Hin`` (the chunk kernels keep their per-chunk states ``[K, V]``)."""
    if packed:
        h: Tensor = torch.where((count > 0).view(-1, 1, 1, 1), Hin.to(dtype), Hin.new_zeros((), dtype=dtype))
        h = h.unsqueeze(0)
    else:
        nch = (T + C - 1) // C
        h = Hin[: B * nch].to(dtype).unflatten(0, (B, nch))
    return h.transpose(-1, -2).contiguous() if state_v_first else h


def sequence_chunks(cu_seqlens: Tensor, C: int) -> tuple[Tensor, Tensor]:
    """Per sequence of sanitized ``cu_seqlens``: its number of chunks ``cdiv(len, C)`` and the chunk index one past
    its last chunk (their inclusive prefix sum), ``[N]`` int64 each. The first slot is ``ends - chunks``."""
    chunks = torch.div(cu_seqlens[1:] - cu_seqlens[:-1] + (C - 1), C, rounding_mode="floor")
    return chunks, chunks.cumsum(0)


@dataclass(frozen=True)
class ChunkSlots:
    """The chunk map: for slot ``c``, sequence ``seq[c]``, first token ``start[c]``, ``count[c]`` tokens (0: empty)."""

    seq: Tensor  # [NC] int64, clamped to N - 1 for empty slots
    start: Tensor  # [NC] int64
    count: Tensor  # [NC] int64 in [0, C]
    first: Tensor  # [NC] bool: the first chunk of its sequence
    last: Tensor  # [NC] bool: the last chunk of its sequence


def chunk_slots(cu_seqlens: Tensor, T: int, C: int) -> ChunkSlots:
    """Build the chunk map for sanitized ``cu_seqlens [N + 1]`` over ``T`` tokens and chunk size ``C``."""
    N = cu_seqlens.shape[0] - 1
    NC = num_chunk_slots(T, N, C)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    nchunks, ends = sequence_chunks(cu_seqlens, C)
    c = torch.arange(NC, device=cu_seqlens.device, dtype=torch.int64)
    seq = torch.searchsorted(ends, c, right=True).clamp(max=max(N - 1, 0))
    valid = c < ends[-1] if N > 0 else torch.zeros_like(c, dtype=torch.bool)
    j = c - (ends[seq] - nchunks[seq])  # chunk index inside its sequence
    start = cu_seqlens[seq] + j * C
    count = torch.where(valid, (lens[seq] - j * C).clamp(0, C), torch.zeros_like(c))
    first = valid & (j == 0)
    last = valid & (j == nchunks[seq] - 1)
    return ChunkSlots(seq=seq, start=start, count=count, first=first, last=last)


class SlotRows(Protocol):
    """What a chunk kernel reads of a chunk map: slot ``c`` covers tokens ``start[c] .. start[c] + count[c]``."""

    @property
    def start(self) -> Tensor: ...

    @property
    def count(self) -> Tensor: ...


@dataclass(frozen=True)
class ChunkMap:
    """The chunk map of the Triton kernels, in as few device ops as possible (each is a launch on the call path).

    ``cu [N + 1]``: the sanitized flat ``cu_seqlens``; ``start, count [NC]`` as in :class:`ChunkSlots` (``start`` is
    arbitrary where ``count`` is 0); ``offset [N]``: the first slot of each sequence. All int64.
    """

    cu: Tensor
    start: Tensor
    count: Tensor
    offset: Tensor


def _dense_map(B: int, T: int, C: int, device: torch.device) -> ChunkMap:
    """The chunk map of a dense batch ``[B, T]`` (``B * T > 0``) in 11 device ops."""
    nch = (T + C - 1) // C
    NC = num_chunk_slots(B * T, B, C)
    cC = torch.arange(0, NC * C, C, device=device, dtype=torch.int64)  # c * C
    seq = torch.div(cC, nch * C, rounding_mode="floor").clamp_(max=B - 1)
    # start = seq * T + j * C with j = c - seq * nch: the chunk's index inside its sequence
    start = seq * (T - nch * C) + cC
    count = (seq * (nch * C) - cC + T).clamp_(0, C)
    cu = torch.arange(0, (B + 1) * T, T, device=device, dtype=torch.int64)
    offset = torch.arange(0, B * nch, nch, device=device, dtype=torch.int64)
    return ChunkMap(cu, start, count, offset)


def chunk_map(cu_seqlens: Tensor | None, B: int, T: int, C: int, device: torch.device) -> ChunkMap:
    """The :class:`ChunkMap` of a batch ``[B, T]`` (``cu_seqlens`` None) or of ``cu_seqlens`` over ``B * T`` tokens.

    Equal to :func:`flat_cu_seqlens`, :func:`chunk_slots` and the sequences' first slots (tests/test_varlen.py),
    in 11 device ops for a dense batch and 19 with ``cu_seqlens``, against about 45 (the Triton drivers build a
    dense batch's map in one launch, :mod:`kda_ops.triton.chunk.slots`, checked equal to this one). Not cached: a
    map built during a ``reduce-overhead`` warm-up lives in the CUDA-graph tree's memory pool, which the tree
    reclaims (a cache made this way failed ``test_prefill_and_decode_reduce_overhead_equal_to_eager`` on the H200).
    """
    total = B * T
    if cu_seqlens is None and total > 0:
        return _dense_map(B, T, C, device)
    cu = flat_cu_seqlens(cu_seqlens, B, T, device)
    N = cu.shape[0] - 1
    NC = num_chunk_slots(total, N, C)
    if N == 0:
        zeros = torch.zeros(NC, device=device, dtype=torch.int64)
        return ChunkMap(cu, zeros, zeros, cu[:0])
    chunks, ends = sequence_chunks(cu, C)
    offset = ends - chunks
    c = torch.arange(NC, device=device, dtype=torch.int64)
    seq = torch.searchsorted(ends, c, right=True).clamp_(max=N - 1)
    start = c.sub_(offset[seq]).mul_(C).add_(cu[seq])
    count = (cu[1:][seq] - start).clamp_(0, C)
    return ChunkMap(cu, start, count, offset)


def zero_padding_rows(o: Tensor, valid: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """``o [B, T, HV, V]`` with the rows of padding sequences (``valid [N]`` False: a pool slot outside the pool)
    set to zero, on the device: the serving ops' contract for a padding sequence."""
    T = o.shape[1]
    if cu_seqlens is None:
        keep = valid[:, None, None, None]
    else:
        cu = sanitize_cu_seqlens(cu_seqlens, T)
        N = cu.shape[0] - 1
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=o.device), right=True).clamp(max=max(N - 1, 0))
        keep = valid[seq][None, :, None, None]
    return torch.where(keep, o, torch.zeros((), dtype=o.dtype, device=o.device))
