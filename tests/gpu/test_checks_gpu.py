"""The checked mode on CUDA: each value the fast path trusts, when bad, raises the CPU checks' error; off, no call
synchronises with the device (``torch.cuda.set_sync_debug_mode("error")``) and none launches the checks' kernels."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import kda_ops
from kda_ops.testing import make_inputs

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(T: int = 40) -> dict[str, torch.Tensor]:
    x = make_inputs(1, T, 2, 32, 32, device=DEV, seed=1)
    return {n: x[n] for n in ("q", "k", "v", "g", "beta")}


CU = {
    "first not 0": ([1, 20, 40], "cu_seqlens"),
    "last not T": ([0, 20, 39], "cu_seqlens"),
    "decreasing": ([0, 30, 20, 40], "cu_seqlens"),
}


@pytest.mark.parametrize("case", list(CU))
@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
def test_cu_seqlens(case: str, fn: Any, checked: None) -> None:
    cu, name = CU[case]
    with torch.no_grad(), pytest.raises(ValueError, match=f"^{name}:"):
        fn(**_inputs(), cu_seqlens=torch.tensor(cu, device=DEV))


@pytest.mark.parametrize(("slots", "what"), [([0, 5], "out of range"), ([1, 1], "repeated")])
def test_state_indices(slots: list[int], what: str, checked: None) -> None:
    x = _inputs()
    pool = torch.zeros(4, 2, 32, 32, device=DEV)
    with torch.no_grad(), pytest.raises(ValueError, match="^state_indices:"):
        kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=torch.tensor(slots, device=DEV),
                                      cu_seqlens=torch.tensor([0, 20, 40], device=DEV))  # fmt: skip


@pytest.mark.parametrize(("name", "value"), [("g", 0.5), ("g", float("nan")), ("beta", 1.5), ("beta", -0.5)])
def test_gate_and_beta(name: str, value: float, checked: None) -> None:
    x = _inputs()
    x[name].view(-1)[7] = value
    with torch.no_grad(), pytest.raises(ValueError, match=f"^{name}:"):
        kda_ops.chunk_kda(**x)


def test_off_no_call_synchronises() -> None:
    x = _inputs()
    cu = torch.tensor([0, 20, 40], device=DEV)
    pool = torch.zeros(4, 2, 32, 32, device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    with torch.no_grad():
        kda_ops.chunk_kda(**x, cu_seqlens=cu)  # compile first
        kda_ops.recurrent_kda(**x, cu_seqlens=cu)
        kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=slots, cu_seqlens=cu)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            kda_ops.chunk_kda(**x, cu_seqlens=cu)
            kda_ops.recurrent_kda(**x, cu_seqlens=cu)
            kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=slots, cu_seqlens=cu)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _kernels(call: Any) -> collections.Counter[str]:
    """The CUDA kernels ``call`` launches (torch.profiler), by name and count."""
    from torch.profiler import ProfilerActivity, profile

    call()  # compile first
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_off_the_calls_launch_no_check() -> None:
    """Off, each public function launches a subset of its checked launches, and strictly fewer: the checks' work
    runs only when asked for."""
    x = _inputs()
    cu = torch.tensor([0, 20, 40], device=DEV)
    pool = torch.zeros(4, 2, 32, 32, device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    calls = {
        "chunk": lambda: kda_ops.chunk_kda(**x, cu_seqlens=cu),
        "recurrent": lambda: kda_ops.recurrent_kda(**x, cu_seqlens=cu),
        "serving": lambda: kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=slots, cu_seqlens=cu),
    }
    with torch.no_grad():
        for name, call in calls.items():
            off = _kernels(call)
            kda_ops.set_checks(True)
            try:
                on = _kernels(call)
            finally:
                kda_ops.set_checks(False)
            assert off <= on and off != on, (name, off, on)
