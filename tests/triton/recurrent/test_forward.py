"""``kda_ops.triton.recurrent.forward``: the fused recurrent forward (and the kernel entry) on the CPU under
``TRITON_INTERPRET=1``, against the float64 oracle (the naive recurrence).

Every call runs with the ops routed to Triton (``ops.cpu_backend("triton")``) and the launchers' outputs poisoned
with NaN, so an element a kernel forgets to write fails the comparison. Shapes are tiny: the interpreter runs
programs one by one at a few milliseconds per token step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

import kda_ops  # noqa: E402
from kda_ops.testing import assert_rel, make_inputs, make_state  # noqa: E402
from kda_ops.triton import KERNELS  # noqa: E402
from tests.cases import CU_RECURRENT, F64, RECURRENT_OPTIONS  # noqa: E402
from tests.triton.recurrent.checks import case, compare  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("triton_path")]


@pytest.mark.parametrize("name", RECURRENT_OPTIONS)
def test_forward_every_option(name: str) -> None:
    x = case(name, 2, 9, 1, 12, 10, HV=2, dtype=torch.float32)
    compare(x, h0=make_state(2, 2, 12, 10), tol=1e-5)


@pytest.mark.parametrize("name", ["plain", "all"])
def test_forward_fp16(name: str) -> None:
    x = case(name, 2, 9, 1, 16, 16, HV=2, dtype=torch.float16)
    compare(x, h0=make_state(2, 2, 16, 16))


def test_forward_fp64_exact() -> None:
    """In float64 the kernel computes in float64: equal to the oracle to rounding."""
    x = case("all", 1, 8, 1, 12, 10, HV=2, dtype=F64)
    compare(x, h0=make_state(1, 2, 12, 10, dtype=F64), tol=1e-12)


def test_forward_no_state() -> None:
    x = case("plain", 2, 6, 1, 8, 8, HV=1, dtype=torch.float32)
    compare(x, final=False, tol=1e-5)
    o, s = kda_ops.recurrent_kda(**x)
    assert s is None and o.shape == (2, 6, 1, 8)


def test_forward_gva() -> None:
    x = case("l2norm", 1, 8, 2, 8, 8, HV=4, dtype=torch.float32)
    compare(x, h0=make_state(1, 4, 8, 8), tol=1e-5)


def test_forward_varlen_empty_sequences() -> None:
    cu = torch.tensor(CU_RECURRENT, dtype=torch.int32)
    x = case("gate", 1, 11, 1, 8, 12, HV=1, dtype=torch.float32)
    h0 = make_state(4, 1, 8, 12)
    compare(x, h0=h0, cu=cu, tol=1e-5)
    _, s = kda_ops.recurrent_kda(**x, initial_state=h0, cu_seqlens=cu, output_final_state=True)
    assert s is not None
    torch.testing.assert_close(s[1], h0[1], rtol=0, atol=0)  # empty sequences keep their initial state
    torch.testing.assert_close(s[3], h0[3], rtol=0, atol=0)


def test_forward_tiled_values(small_tiles: None) -> None:
    x = case("all", 2, 7, 1, 12, 10, HV=2, dtype=torch.float32)
    compare(x, h0=make_state(2, 2, 12, 10), tol=1e-5)


def test_forward_extreme_gates() -> None:
    """A hard reset (g = -1000) and no decay (g = 0): nothing overflows, nothing leaks."""
    x = case("plain", 1, 10, 1, 8, 8, HV=2, dtype=torch.float32)
    x["g"][:, 3] = -1000.0
    x["g"][:, 6:] = 0.0
    compare(x, h0=make_state(1, 2, 8, 8), tol=1e-5)


def test_kernel_entry_matches_reference_kernel() -> None:
    """``KERNELS["recurrent"]`` has the reference kernel's signature and results."""
    from kda_ops import reference
    from kda_ops.common import Options

    x = make_inputs(2, 5, 1, 8, 8, HV=2)
    opts = Options(use_qk_l2norm=True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, make_state(2, 2, 8, 8), None, None, None, opts, True)
    o, s = KERNELS["recurrent"](*args)
    o_ref, s_ref = reference.recurrent_fwd(*args)
    assert_rel(o, o_ref, 1e-6)
    assert_rel(s, s_ref, 1e-6)
    o, s = KERNELS["recurrent"](*args[:-1], False)
    assert s.shape == (0,)


def test_kernel_compiles_for_sm90_and_decode_does_not_spill() -> None:
    """The forward (and serving) kernel lowers for sm_90 for every flag combination that matters, and its decode
    variants do not spill registers (``tests/triton/sm90.py``)."""
    check_compiles("recurrent.forward", no_spills=lambda variant: variant.startswith("decode"))
