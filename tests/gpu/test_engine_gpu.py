"""The engine-like serving loop (``tests/engine.py``) on the GPU: 64 sequences arriving and finishing over 200
steps, chunked prefill into the pool, decode and speculative verify steps each captured once in a CUDA graph and
replayed; every sequence's outputs equal to running it alone through ``recurrent_kda`` (fp32 pool)."""

from __future__ import annotations

import pytest

from tests.engine import check_engine, run_engine

pytestmark = pytest.mark.gpu


def test_engine_loop_with_cuda_graphs() -> None:
    seqs = run_engine("cuda", steps=200, batch=64, H=4, D=128, seed=2, graphs=True)
    assert check_engine(seqs, tol=1e-5) >= 64
