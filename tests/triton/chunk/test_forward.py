"""``kda_ops.triton.chunk.forward``: the chunkwise forward driver on the CPU under ``TRITON_INTERPRET=1``, through
``kda_ops.chunk_kda`` (ops routed to Triton) against the float64 naive recurrence, and as the kernel entry
``KERNELS["chunk"]`` against the reference kernel. Every launcher's outputs and scratch buffers are poisoned with NaN
first, so an element a kernel forgets to write fails the comparison. Shapes are tiny: the interpreter runs programs
one by one. The stages alone: ``test_decays.py`` ... ``test_output.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", minversion="3.6")

import kda_ops  # noqa: E402
from kda_ops import ops, reference  # noqa: E402
from kda_ops.common import Options  # noqa: E402
from kda_ops.reference import naive_recurrent_kda  # noqa: E402
from kda_ops.testing import assert_rel, make_inputs, make_state, rel_err  # noqa: E402
from kda_ops.triton import KERNELS  # noqa: E402
from kda_ops.triton.chunk.forward import chunk_fwd  # noqa: E402
from kda_ops.triton.launch import force_forms  # noqa: E402
from tests.cases import CHUNK_OPTIONS, CU_STAGES, F64, double, option_inputs, options, set_gates  # noqa: E402
from tests.triton.chunk.stage_kernels import chunk_fwd_staged  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS  # noqa: E402

pytestmark = [pytest.mark.interpret, *OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]


def _case(name: str, B: int, T: int, H: int, K: int, V: int, HV: int, dtype: torch.dtype = torch.float32,
          gates: str = "normal", seed: int = 0) -> dict[str, Any]:  # fmt: skip
    x = option_inputs(name, B, T, H, K, V, HV=HV, dtype=dtype, seed=seed)
    set_gates(x["g"], gates)
    return x


def _compare(x: dict[str, Any], *, h0: torch.Tensor | None = None, cu: torch.Tensor | None = None, final: bool = True,
             tol: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``chunk_kda`` on the Triton path against the float64 naive recurrence.

    Tolerance ``tol``, or (from data) 1e-5 or twice the error of the fp32 reference chunk kernel on the same
    inputs, whichever is larger: without l2norm the keys are long and the solve ill-conditioned for any fp32 code.
    """
    o, s = kda_ops.chunk_kda(**x, initial_state=h0, cu_seqlens=cu, output_final_state=final)
    h0d = None if h0 is None else h0.double()
    o_ref, s_ref = naive_recurrent_kda(**double(x), initial_state=h0d, cu_seqlens=cu, output_final_state=final)
    limits = {"o": tol, "final_state": tol}
    if tol is None:
        with ops.cpu_backend("reference"):
            o32, s32 = kda_ops.chunk_kda(**x, initial_state=h0, cu_seqlens=cu, output_final_state=final)
        limits = {"o": max(1e-5, 2 * rel_err(o32, o_ref))}
        if final:
            assert s32 is not None and s_ref is not None
            limits["final_state"] = max(1e-5, 2 * rel_err(s32, s_ref))
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    assert_rel(o, o_ref, limits["o"], "o")  # type: ignore[arg-type]
    if final:
        assert s is not None and s_ref is not None
        assert s.dtype == (F64 if x["v"].dtype == F64 else torch.float32)
        assert_rel(s, s_ref, limits["final_state"], "final_state")  # type: ignore[arg-type]
    else:
        assert s is None
    return o, s


@pytest.mark.parametrize("name", CHUNK_OPTIONS)
def test_forward_every_option(name: str) -> None:
    x = _case(name, 2, 70, 1, 16, 16, HV=2)
    _compare(x, h0=make_state(2, 2, 16, 16))


@pytest.mark.parametrize("T", [1, 63, 64, 65, 128])
def test_forward_lengths(T: int) -> None:
    x = _case("l2norm", 1, T, 1, 16, 16, HV=1)
    _compare(x, h0=make_state(1, 1, 16, 16), tol=1e-5)


def test_forward_varlen_gva_odd_dims() -> None:
    """Packed sequences with an empty and a one-token sequence, grouped value heads, K and V not powers of two."""
    cu = torch.tensor(CU_STAGES, dtype=torch.int32)
    x = _case("all", 1, CU_STAGES[-1], 1, 20, 12, HV=2)
    h0 = make_state(len(CU_STAGES) - 1, 2, 20, 12)
    _, s = _compare(x, h0=h0, cu=cu, tol=1e-5)
    assert s is not None
    assert torch.equal(s[1], h0[1]), "an empty sequence keeps its initial state"


@pytest.mark.slow
@pytest.mark.parametrize("gates", ["reset", "zero", "strong"])
def test_forward_extreme_gates(gates: str) -> None:
    """Hard resets (g = -1000), no decay, and blocks beyond the factored span: nothing overflows or leaks."""
    cu = torch.tensor(CU_STAGES, dtype=torch.int64)
    x = _case("l2norm", 1, CU_STAGES[-1], 1, 16, 16, HV=2, gates=gates)
    _compare(x, h0=make_state(len(CU_STAGES) - 1, 2, 16, 16), cu=cu, tol=1e-5)


def test_forward_fp16() -> None:
    """fp16 inputs compute in fp32 and store the per-chunk factors in bf16 (range-safe): bf16-level error."""
    x = _case("all", 1, 100, 1, 16, 16, HV=2, dtype=torch.float16)
    _compare(x, h0=make_state(1, 2, 16, 16), tol=1e-2)


def test_forward_fp64_exact() -> None:
    x = _case("all", 1, 80, 1, 12, 10, HV=2, dtype=F64, gates="reset")
    _compare(x, h0=make_state(1, 2, 12, 10, dtype=F64), tol=1e-11)


def test_forward_no_state() -> None:
    x = _case("l2norm", 2, 40, 1, 16, 16, HV=1)
    _compare(x, final=False, tol=1e-5)


def test_forward_tiled_values() -> None:
    x = _case("all", 1, 70, 1, 16, 40, HV=2)
    with force_forms(scan_block_v=16):
        _compare(x, h0=make_state(1, 2, 16, 40), tol=1e-5)


def test_forward_split_scan() -> None:
    """The forward with its scan split into 3 segments per sequence (of 4 chunks, every option)."""
    x = _case("all", 2, 250, 1, 16, 16, HV=2)
    with force_forms(scan_segments=3):
        _compare(x, h0=make_state(2, 2, 16, 16), tol=1e-5)


@pytest.mark.slow
def test_staged_pipeline_equals_fused() -> None:
    cu = torch.tensor(CU_STAGES, dtype=torch.int64)
    x = _case("all", 1, CU_STAGES[-1], 1, 20, 12, HV=2, gates="reset")
    h0 = make_state(len(CU_STAGES) - 1, 2, 20, 12)
    o_ref, s_ref = naive_recurrent_kda(**double(x), initial_state=h0.double(), cu_seqlens=cu, output_final_state=True)
    assert s_ref is not None
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, h0, cu, x["A_log"], x["dt_bias"], options(x), True)
    o_ref, s_ref = reference.chunk_fwd(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                         for a in args])  # fmt: skip
    for fn in (chunk_fwd, chunk_fwd_staged):
        o, s = fn(*args)
        assert_rel(o, o_ref, 1e-5, f"{fn.__name__} o")
        assert_rel(s, s_ref, 1e-5, f"{fn.__name__} final")


def test_chunk_equals_recurrent_kernel() -> None:
    """The two Triton schedules compute one function."""
    x = _case("all", 2, 50, 1, 16, 16, HV=2)
    h0 = make_state(2, 2, 16, 16)
    o_c, s_c = kda_ops.chunk_kda(**x, initial_state=h0, output_final_state=True)
    o_r, s_r = kda_ops.recurrent_kda(**x, initial_state=h0, output_final_state=True)
    assert s_c is not None and s_r is not None
    assert_rel(o_c, o_r, 1e-5, "o")
    assert_rel(s_c, s_r, 1e-5, "final_state")


def test_kernel_entry_matches_reference_kernel() -> None:
    """``KERNELS["chunk"]`` has the reference kernel's signature and results; no final state gives ``(0,)``."""
    x = make_inputs(2, 20, 1, 8, 8, HV=2)
    x["g"] = F.logsigmoid(torch.randn(x["g"].shape, generator=torch.Generator().manual_seed(5)))
    opts = Options(use_qk_l2norm=True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, make_state(2, 2, 8, 8), None, None, None, opts, True)
    o, s = KERNELS["chunk"](*args)
    o_ref, s_ref = reference.chunk_fwd(*args)
    assert_rel(o, o_ref, 1e-5)
    assert_rel(s, s_ref, 1e-5)
    o, s = KERNELS["chunk"](*args[:-1], False)
    assert s.shape == (0,)
