"""``kda_ops.triton.chunk.dv``: the backward's stage 3a (``dv``, ``dbeta`` through ``U`` and ``W``, ``dMqk``,
``dMkk``, ``dKt``, ``Gam``), fed the float64 oracle's forward factors and reverse scan, against its oracle
(``kda_ops.reference.chunk.dv``), under the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.reference.chunk.dv import dv as oracle_dv  # noqa: E402
from kda_ops.testing import assert_rel  # noqa: E402
from kda_ops.triton import launch  # noqa: E402
from kda_ops.triton.chunk.dv import chunk_bwd_dv  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS, bwd_precisions, bwd_stage_case, dv_inputs, f32  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [*OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]


@pytest.mark.parametrize("gates", ["normal", "reset"])
def test_stage_dv(gates: str, device: torch.device) -> None:
    c = bwd_stage_case(gates, H=1, HV=2, device=device)
    c.update(dv_inputs(c))
    prec, prec_t = bwd_precisions(device)
    got = chunk_bwd_dv(*f32(c, "k", "v", "g", "beta", "Tm", "Hin", "E", "dE", "dO"), c["slots"], prec, prec_t)
    ref = oracle_dv(c["k"], c["v"], c["g"], c["beta"], c["Tm"], c["Hin"], c["E"], c["dE"], c["dO"], c["slots"], BT)
    for name, a, b in zip(("dv", "dbeta", "dMqk", "dMkk", "dKt", "Gam"), got, ref):
        assert_rel(a, b, 1e-5, name)
    # dMqk, dMkk, dKt stored in bf16 (the driver's choice for bf16 inputs): one rounding each (within one bf16 ulp:
    # the interpreter truncates where the GPU rounds to nearest); dv, dbeta and Gam untouched
    got16 = chunk_bwd_dv(*f32(c, "k", "v", "g", "beta", "Tm", "Hin", "E", "dE", "dO"), c["slots"], prec, prec_t,
                         store=torch.bfloat16)  # fmt: skip
    for name, a, b in zip(("dv", "dbeta", "dMqk", "dMkk", "dKt", "Gam"), got16, got):
        if name in ("dMqk", "dMkk", "dKt"):
            assert a.dtype == torch.bfloat16, name
            torch.testing.assert_close(a.float(), b, rtol=2.0**-7, atol=1e-30, msg=name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("flags", [{"PREFETCH": 1}, {"LATE_STORE": 1}], ids=["prefetch", "late_store"])
def test_stage_dv_schedule_flags(flags: dict[str, int], device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's schedule flags in the launch table (the next value tile's loads ahead of the ``dv`` store, the
    store after the tile's products) against the oracle, and bit for bit the default form's outputs: under the
    interpreter (same operations in the same order) both forms, on a GPU the late store (there the compiler groups
    the prefetching form's sums otherwise: its gradients differ from the default's by a rounding). V = 40: two
    value tiles, the second partial (outputs poisoned first, by the ``triton_path`` fixture)."""
    c = bwd_stage_case("normal", H=1, HV=2, V=40, device=device)
    c.update(dv_inputs(c))
    prec, prec_t = bwd_precisions(device)
    args = f32(c, "k", "v", "g", "beta", "Tm", "Hin", "E", "dE", "dO")
    base = chunk_bwd_dv(*args, c["slots"], prec, prec_t)
    monkeypatch.setitem(launch.LAUNCH, "dv", {**launch.LAUNCH["dv"], **flags})
    got = chunk_bwd_dv(*args, c["slots"], prec, prec_t)
    ref = oracle_dv(c["k"], c["v"], c["g"], c["beta"], c["Tm"], c["Hin"], c["E"], c["dE"], c["dO"], c["slots"], BT)
    for name, a, b, r in zip(("dv", "dbeta", "dMqk", "dMkk", "dKt", "Gam"), got, base, ref):
        assert_rel(a, r, 1e-5, name)
        if device.type == "cpu" or "PREFETCH" not in flags:
            assert torch.equal(a, b), name


def test_kernels_compile_for_sm90() -> None:
    """The dv stage lowers for sm_90 as the backward launches it, within the backward's spill bound
    (``tests/triton/sm90.py``)."""
    check_compiles("chunk.dv")


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["PREFETCH=1", "LATE_STORE=1"])
def test_schedule_flags_compile_for_sm90(flag: str) -> None:
    """The stage with its schedule flags lowers for sm_90 within the spill bound."""
    check_compiles("chunk.dv", flag)
