"""The Triton path's chunk map (``varlen.chunk_map``) equals the reference's (``flat_cu_seqlens``, ``chunk_slots``
and each sequence's first slot) for dense batches and for ``cu_seqlens`` with empty sequences and values outside
the contract (which both sanitize the same way)."""

from __future__ import annotations

import random

import pytest
import torch

from kda_ops.varlen import chunk_map, chunk_slots, flat_cu_seqlens

CPU = torch.device("cpu")


def _check(cu: torch.Tensor | None, B: int, T: int, C: int) -> None:
    m = chunk_map(cu, B, T, C, CPU)
    flat = flat_cu_seqlens(cu, B, T, CPU)
    ref = chunk_slots(flat, B * T, C)
    chunks = (flat[1:] - flat[:-1] + C - 1) // C
    assert torch.equal(m.cu, flat)
    assert torch.equal(m.count, ref.count)
    used = ref.count > 0
    assert torch.equal(m.start[used], ref.start[used])
    assert torch.equal(m.offset, torch.cumsum(chunks, 0) - chunks)
    assert all(t.dtype == torch.int64 for t in (m.cu, m.start, m.count, m.offset))


@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("B", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("T", [0, 1, 15, 16, 17, 63, 64, 65, 130, 1000])
def test_dense(B: int, T: int, C: int) -> None:
    _check(None, B, T, C)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_varlen_random(dtype: torch.dtype) -> None:
    rng = random.Random(0)
    for _ in range(300):
        T, C, N = rng.randint(0, 300), rng.choice((16, 64)), rng.randint(1, 8)
        values = [0, *sorted(rng.randint(0, T) for _ in range(N - 1)), T]
        if rng.random() < 0.2:  # out of the contract: sanitized (clamped, made non-decreasing) by both
            values = [rng.randint(-5, T + 5) for _ in range(N + 1)]
        _check(torch.tensor(values, dtype=dtype), 1, T, C)


def test_no_sequence() -> None:
    """N = 0 (the public functions reject it; the map still stays in bounds): every slot empty."""
    m = chunk_map(torch.tensor([0]), 1, 10, 16, CPU)
    assert m.count.shape == (1,) and int(m.count.sum()) == 0 and m.offset.numel() == 0
