"""``kda_ops.triton.chunk.output``: the output stage ``O = Qt S + Mqk E`` (in the X form ``Qt S + (Mqk Tb) X``) on
the float64 oracle's states and errors, against the oracle's outputs (``kda_ops.reference.chunk.output``), under
the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.reference.chunk.output import output as oracle_output  # noqa: E402
from kda_ops.reference.chunk.scan import scan as oracle_scan  # noqa: E402
from kda_ops.testing import assert_rel, make_state  # noqa: E402
from kda_ops.triton.chunk.output import chunk_output  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from tests.cases import CU_STAGES  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS, factors, stage_case, stage_precision, used  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [*OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]


@pytest.mark.parametrize("x_form", [False, True], ids=["E_form", "X_form"])
def test_stage_output(x_form: bool, device: torch.device) -> None:
    """The output stage alone on the oracle scan's states and errors (``X`` and ``Mqk Tb`` in the X form, the
    forward's): the outputs of the E form's oracle. The states of the empty slots are NaN (the scan never writes
    them): the stage must not read them."""
    c = stage_case(torch.float32, "reset", "l2norm", V=24, device=device)
    fa = factors(c)
    N, HV, K, V = len(CU_STAGES) - 1, 2, 20, 24
    h0 = make_state(N, HV, K, V, device=device).double()
    Hin_r, E_r, _ = oracle_scan(fa["W"], fa["U"], fa["Kend"], fa["Gl"], h0, c["slots"], BT)
    o_r = oracle_output(fa["Qt"], fa["Mqk"], Hin_r, E_r, c["slots"], BT)
    if x_form:
        E_r = oracle_scan(fa["Kt"], fa["V"], fa["Kb"], fa["Gl"], h0, c["slots"], BT)[1]
    Hin = Hin_r.float()
    Hin[~used(c["slots"])] = float("nan")
    Mqk = fa["MqkTb" if x_form else "Mqk"].float()
    o = chunk_output(fa["Qt"].float(), Mqk, Hin, E_r.float(), c["slots"], stage_precision(device), torch.float32)
    assert_rel(o, o_r, 1e-5, "o (output stage)")


def test_kernels_compile_for_sm90() -> None:
    """The output stage kernel lowers for sm_90 in both its forms (``tests/triton/sm90.py``)."""
    check_compiles("chunk.output")
