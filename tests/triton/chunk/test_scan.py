"""``kda_ops.triton.chunk.scan``: the inter-chunk state scan in its two forms (the E form the backward's recompute
runs, the X form of the forward) against the float64 oracle (``kda_ops.reference.chunk.scan``), with each value
tile, under the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.reference.chunk.scan import scan as oracle_scan  # noqa: E402
from kda_ops.testing import assert_rel, make_state  # noqa: E402
from kda_ops.triton.chunk.scan import chunk_state  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from kda_ops.triton.launch import force_forms  # noqa: E402
from tests.cases import CU_SPLIT, CU_STAGES  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS, factors, stage_case, stage_precision, used  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [*OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]


# (value tile, segments per sequence, packed batch): CU_STAGES has sequences of 0 to 2 chunks
SCANS = [(None, None, CU_STAGES), (16, None, CU_STAGES), (None, 3, CU_STAGES), (16, 2, CU_STAGES), (None, 2, CU_SPLIT),
         (None, 4, CU_SPLIT)]  # fmt: skip


@pytest.mark.parametrize("x_form", [False, True], ids=["E_form", "X_form"])
@pytest.mark.parametrize(("tiles", "segments", "cu"), SCANS, ids=[f"{t}-{s}-{len(c)}" for t, s, c in SCANS])
def test_stage_scan(tiles: int | None, segments: int | None, cu: list[int], x_form: bool, device: torch.device) -> None:
    """The scan alone (states and errors stored), plain or split into ``segments`` per sequence (the split: segments
    scanned from a zero state, their maps combined, each finished from its true initial state; some segments
    empty), against the oracle scan over whole sequences. In the X form (the forward's: ``Kt, V, Kb`` in, ``X``
    out) the states and the final state are those of the E form's oracle, and ``X`` that of the oracle scan on the
    X form's factors."""
    c = stage_case(torch.float32, "normal" if cu is CU_SPLIT else "reset", "l2norm", V=24, device=device,
                   cu_seqlens=cu)  # fmt: skip
    fa = factors(c)
    N, HV, K, V = len(cu) - 1, 2, 20, 24
    h0 = make_state(N, HV, K, V, device=device)
    Hin_r, E_r, final_r = oracle_scan(fa["W"], fa["U"], fa["Kend"], fa["Gl"], h0.double(), c["slots"], BT)
    if x_form:
        E_r = oracle_scan(fa["Kt"], fa["V"], fa["Kb"], fa["Gl"], h0.double(), c["slots"], BT)[1]
    W, U, Kend = ("Kt", "V", "Kb") if x_form else ("W", "U", "Kend")
    f32 = {n: t.float() for n, t in fa.items()}
    final = torch.empty(N, HV, K, V, device=device)
    with force_forms(scan_block_v=tiles, scan_segments=segments):
        Hin, E = chunk_state(f32[W], f32[U], f32[Kend], f32["Gl"], h0, c["cu"], stage_precision(device), final=final,
                             x_form=x_form)  # fmt: skip
    u = used(c["slots"])
    assert_rel(Hin[u], Hin_r[u], 1e-5, "Hin")
    assert_rel(E, E_r, 1e-5, "X" if x_form else "E")
    assert_rel(final, final_r, 1e-5, "final")
    assert torch.equal(final[1], h0[1]), "an empty sequence keeps its initial state"


def test_kernels_compile_for_sm90() -> None:
    """The scan kernel lowers for sm_90, as the forward and the backward's recompute launch it
    (``tests/triton/sm90.py``)."""
    check_compiles("chunk.scan")


@pytest.mark.parametrize(("HV", "T", "segments"), [(4, 32768, 16), (8, 32768, 8), (16, 32768, 4), (32, 32768, 1),
                                                   (4, 1024, 1), (4, 4096, 4)])  # fmt: skip
def test_segment_rule(HV: int, T: int, segments: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The split scan's host rule on a 132-SM card (one sequence, V = 128): segments where the plain scan's programs
    leave SMs idle, a power of two, none shorter than 16 chunks."""
    import kda_ops.triton.chunk.scan as scan_module

    monkeypatch.setattr(scan_module, "num_sms", lambda device: 132)
    assert scan_module.scan_segments(1, HV, T, 128, torch.device("cpu")) == segments
