"""``kda_ops.triton.chunk.solve``: the doubling solve ``Tm = (I + Mkk)^-1`` and the WY factors ``W``, ``U`` (the
stage kernel ``chunk_solve`` built on its device helpers) against the float64 oracle
(``kda_ops.reference.chunk.solve``), under the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.reference.chunk.intra import intra as oracle_intra  # noqa: E402
from kda_ops.reference.chunk.solve import solve as oracle_solve  # noqa: E402
from kda_ops.testing import assert_rel  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from tests.cases import F64  # noqa: E402
from tests.triton.chunk.stage_kernels import chunk_solve  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS, kt, stage_case, stage_precision  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [*OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]


@pytest.mark.parametrize(("gates", "option"), [("normal", "plain"), ("reset", "all")])
def test_stage_solve(gates: str, option: str, device: torch.device) -> None:
    c = stage_case(torch.float32, gates, option, device=device)
    f, p = c["flat"], c["p"]
    _, Mkk, *_ = oracle_intra(p["q"], p["k"], p["g"], p["beta"], 0.4, c["slots"], BT)
    got = chunk_solve(Mkk.float(), kt(c).float(), f["v"], f["beta"], c["slots"], c["opts"], stage_precision(device))
    ref = oracle_solve(Mkk, p["k"], p["v"], p["g"], p["beta"], c["slots"], BT)
    for name, a, b in zip(("Tm", "W", "U"), got, ref):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize("entry", [1.0, -0.3], ids=["alternating_inverse", "growing_inverse"])
def test_stage_solve_ill_conditioned(entry: float, device: torch.device) -> None:
    """The doubling solve on chunks whose every ``Mkk`` entry below the diagonal is ``entry``: with 1.0 (identical
    unit keys, beta 1, no decay) the Neumann terms reach C(62, 31) ~ 1e17 while the inverse holds 0 and +-1 (a
    power series would lose everything to cancellation); with -0.3 the inverse grows to 1.3^62 ~ 1e7. Against the
    float64 inverse of each chunk's (partial) block."""
    c = stage_case(torch.float32, device=device)
    f, slots = c["flat"], c["slots"]
    T, HV = f["v"].shape[0], f["v"].shape[1]
    Mkk = torch.zeros(T, HV, BT, dtype=F64, device=device)
    ref = torch.zeros(T, HV, BT, dtype=F64, device=device)
    for start, count in zip(slots.start.tolist(), slots.count.tolist()):
        if count == 0:
            continue
        N = torch.tril(torch.full((count, count), entry, dtype=F64, device=device), diagonal=-1)
        Mkk[start : start + count, :, :count] = N[:, None, :]
        eye = torch.eye(count, dtype=F64, device=device)
        ref[start : start + count, :, :count] = torch.linalg.inv(eye + N)[:, None, :]
    Tm, _, _ = chunk_solve(Mkk.float(), kt(c).float(), f["v"], f["beta"], slots, c["opts"], stage_precision(device))
    assert_rel(Tm, ref, 1e-5, "Tm")


def test_kernels_compile_for_sm90() -> None:
    """The solve stage kernel (on this module's device helpers) lowers for sm_90 (``tests/triton/sm90.py``)."""
    check_compiles("chunk.solve")
