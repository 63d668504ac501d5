"""``kda_ops.triton.chunk.decays``: the chunk-local cumulative log decays after the gate (the stage kernel
``chunk_local_cumsum`` built on its device helpers) and the anchor sums of the forward's prepare kernel, each
against the float64 oracle (``kda_ops.reference.chunk.decays``), under the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.reference.chunk.decays import decays as oracle_decays  # noqa: E402
from kda_ops.testing import assert_rel  # noqa: E402
from kda_ops.triton.chunk.decays import chunk_anchor_sums  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from tests.triton.chunk.stage_kernels import chunk_local_cumsum  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS, stage_case, used  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [*OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]


@pytest.mark.parametrize("option", ["plain", "gate", "gate_no_dt_bias", "lower_bound", "lower_bound_no_A"])
def test_stage_cumsum(option: str, device: torch.device) -> None:
    c = stage_case(torch.float32, gates="reset" if option == "plain" else "normal", option=option, device=device)
    Gam, Gl = chunk_local_cumsum(c["flat"]["g"], c["slots"], c["A_log"], c["dt_bias"], c["opts"])
    Gam_ref, Gl_ref = oracle_decays(c["p"]["g"], c["slots"], BT)
    assert_rel(Gam, Gam_ref, 1e-6, "Gam")
    u = used(c["slots"])
    assert_rel(Gl[u], Gl_ref[u], 1e-6, "Gam_last")


@pytest.mark.parametrize("option", ["plain", "gate", "lower_bound"])
def test_stage_anchor_sums(option: str, device: torch.device) -> None:
    """``chunk_anchor_sums``: per slot, ``g_0``, ``P_last`` and ``P_mid`` of the chunk's log decay after the gate,
    against the float64 oracle's prefix sums (a partial chunk's ``P_mid`` stops at its last row)."""
    c = stage_case(torch.float32, gates="reset" if option == "plain" else "normal", option=option, device=device)
    Sums = chunk_anchor_sums(c["flat"]["g"], c["slots"], c["A_log"], c["dt_bias"], c["opts"])
    Gam_ref, Gl_ref = oracle_decays(c["p"]["g"], c["slots"], BT)
    u = torch.nonzero(used(c["slots"])).flatten()
    start, count = c["slots"].start[u], c["slots"].count[u]
    g0 = Gam_ref[start]
    ref = torch.stack([g0, Gl_ref[u] - g0, Gam_ref[start + (count - 1).clamp(max=BT // 2 - 1)] - g0], dim=2)
    assert_rel(Sums[u], ref, 1e-6, "anchor sums")


def test_kernels_compile_for_sm90() -> None:
    """The anchor sums kernel, and the cumsum stage kernel on this module's device helpers, lower for sm_90
    (``tests/triton/sm90.py``)."""
    check_compiles("chunk.decays")
