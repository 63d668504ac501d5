"""Sequence and chunk bookkeeping built on the device, without reading values on the host.

Every schedule sees a batch as a flat stream of ``T`` tokens split into ``N`` sequences by ``cu_seqlens``
(a dense batch ``[B, T]`` is ``N = B`` sequences of ``T`` tokens each). The chunk map has a *static* size,
``cdiv(T, C) + N`` slots, which bounds the number of chunks for any split; slots past the last chunk are empty.
Only ``T``, ``N`` and ``C`` shape the result, so one compiled graph or captured CUDA graph serves every
``cu_seqlens`` of the same length.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    nchunks = (lens + C - 1) // C
    ends = torch.cumsum(nchunks, 0)  # [N] chunk index one past each sequence
    c = torch.arange(NC, device=cu_seqlens.device, dtype=torch.int64)
    seq = torch.searchsorted(ends, c, right=True).clamp(max=max(N - 1, 0))
    valid = c < ends[-1] if N > 0 else torch.zeros_like(c, dtype=torch.bool)
    j = c - (ends[seq] - nchunks[seq])  # chunk index inside its sequence
    start = cu_seqlens[seq] + j * C
    count = torch.where(valid, (lens[seq] - j * C).clamp(0, C), torch.zeros_like(c))
    first = valid & (j == 0)
    last = valid & (j == nchunks[seq] - 1)
    return ChunkSlots(seq=seq, start=start, count=count, first=first, last=last)
