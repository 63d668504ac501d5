"""The engine-like serving loop (``tests/engine.py``) on the CPU: the reference kernels, and under
``TRITON_INTERPRET=1`` the Triton kernels, every sequence's outputs equal to running it alone."""

from __future__ import annotations

import pytest

from kda_ops import ops
from tests.engine import check_engine, run_engine


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpret)])
def test_engine_loop_outputs_equal_each_sequence_alone(backend: str) -> None:
    with ops.cpu_backend(backend):
        seqs = run_engine("cpu", steps=12 if backend == "triton" else 30, batch=4, H=1, D=16, seed=1)
    assert check_engine(seqs, tol=1e-5) >= 4
