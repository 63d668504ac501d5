"""``kda_ops.triton.recurrent.backward``: the gradients of the fused recurrent kernel (its backward) on the CPU under
``TRITON_INTERPRET=1``, against the float64 oracle (the naive recurrence).

Every call runs with the ops routed to Triton (``ops.cpu_backend("triton")``) and the launchers' outputs poisoned
with NaN, so an element a kernel forgets to write fails the comparison. Shapes are tiny: the interpreter runs
programs one by one at a few milliseconds per token step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.testing import make_state  # noqa: E402
from tests.cases import CU_RECURRENT_BWD, F64, RECURRENT_OPTIONS  # noqa: E402
from tests.triton.recurrent.checks import case, compare  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("triton_path")]


@pytest.mark.parametrize("name", RECURRENT_OPTIONS)
def test_gradients_every_option(name: str) -> None:
    x = case(name, 2, 9, 1, 12, 10, HV=2, dtype=torch.float32)
    compare(x, h0=make_state(2, 2, 12, 10), grads=True, tol=1e-5)


def test_gradients_fp16() -> None:
    x = case("all", 1, 8, 1, 16, 16, HV=2, dtype=torch.float16)
    compare(x, h0=make_state(1, 2, 16, 16), grads=True)


def test_gradients_fp64_exact() -> None:
    x = case("all", 1, 9, 1, 8, 6, HV=2, dtype=F64)
    compare(x, h0=make_state(1, 2, 8, 6, dtype=F64), grads=True, tol=1e-11)


def test_gradients_without_state() -> None:
    """No initial state, no final state (so no final-state gradient)."""
    x = case("gate", 2, 9, 1, 8, 8, HV=1, dtype=torch.float32)
    compare(x, final=False, grads=True, tol=1e-5)


def test_gradients_final_state_without_its_gradient() -> None:
    x = case("plain", 2, 9, 1, 8, 8, HV=1, dtype=torch.float32)
    compare(x, h0=make_state(2, 1, 8, 8), grads=True, dht=False, tol=1e-5)


def test_gradients_gva() -> None:
    x = case("all", 1, 9, 2, 8, 8, HV=4, dtype=torch.float32)
    compare(x, h0=make_state(1, 4, 8, 8), grads=True, tol=1e-5)


def test_gradients_varlen_empty_sequences() -> None:
    cu = torch.tensor(CU_RECURRENT_BWD, dtype=torch.int64)
    x = case("all", 1, 14, 1, 8, 8, HV=1, dtype=torch.float32)
    compare(x, h0=make_state(4, 1, 8, 8), cu=cu, grads=True, tol=1e-5)


def test_gradients_tiled_values(small_tiles: None) -> None:
    x = case("all", 1, 9, 1, 12, 10, HV=2, dtype=torch.float32)
    compare(x, h0=make_state(1, 2, 12, 10), grads=True, tol=1e-5)


def test_gradients_long_sequence_many_checkpoints() -> None:
    """T = 32 (B = 1): checkpoint interval 8, so four segments are recomputed and walked backwards."""
    x = case("gate", 1, 32, 1, 8, 8, HV=1, dtype=torch.float32)
    compare(x, h0=make_state(1, 1, 8, 8), grads=True, tol=1e-5)


def test_gradients_extreme_gates() -> None:
    x = case("plain", 1, 12, 1, 8, 8, HV=2, dtype=torch.float32)
    x["g"][:, 2] = -1000.0
    x["g"][:, 7:] = 0.0
    compare(x, h0=make_state(1, 2, 8, 8), grads=True, tol=1e-5)


def test_kernel_compiles_for_sm90() -> None:
    """The backward kernel lowers for sm_90 for every flag combination that matters (``tests/triton/sm90.py``)."""
    check_compiles("recurrent.backward")
