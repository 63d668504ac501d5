"""``kda_ops.triton.chunk.prepare``: the fused stages 1-3 in their two forms, the forward's X form
(``chunk_prepare``) and the backward's recompute (``chunk_prepare_recompute``), against each stage's float64
oracle (``kda_ops.reference.chunk``), under the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.reference.chunk.intra import intra as oracle_intra  # noqa: E402
from kda_ops.reference.chunk.prepare import x_form as oracle_x_form  # noqa: E402
from kda_ops.reference.chunk.solve import solve as oracle_solve  # noqa: E402
from kda_ops.testing import assert_rel  # noqa: E402
from kda_ops.triton.chunk import prepare  # noqa: E402
from kda_ops.triton.chunk.inputs import transform_inputs  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from kda_ops.triton.launch import poison_outputs  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS, kt, stage_case, stage_precision, used  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [*OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]


@pytest.mark.parametrize(
    ("gates", "option", "tol"),
    [("normal", "plain", 5e-5), ("normal", "l2norm", 1e-5), ("reset", "all", 1e-5), ("first_row", "l2norm", 1e-5)],
)
@pytest.mark.slow
def test_stage_prepare(gates: str, option: str, tol: float, device: torch.device) -> None:
    """The fused stages 1-3 against each stage's float64 oracle in their two uses, every output poisoned first: the
    backward's recompute (``chunk_prepare_recompute`` on the inputs after the options, the l2norm factors given:
    ``Mqk`` in fp32, ``W``, ``U``, ``Qt``, ``Kend``, ``Tm``) and the forward's X form (``chunk_prepare``, the options
    in kernel: ``Mqk Tb``, ``Kt``, ``Qt``, ``Kb``; neither ``U`` nor ``Tm``). The cases take the anchored kernel's
    two key loops (without l2norm the key tiles load one step ahead); the "reset" case with the in-kernel gate flags
    no chunk (g is the gate's input there), the flagged chunks' block pass is tested by the flag-loop test below.
    K = 70: three key tiles, the last one partial. Without l2norm the keys' norms (~8) make the solve
    ill-conditioned: the staged stages measure the same 1.9e-5 on W as the fused kernel."""
    c = stage_case(torch.float32, gates, option, K=70, device=device)
    f, p = c["flat"], c["p"]
    prec = stage_precision(device)
    Mqk, Mkk, Qt, Kend, Gl = oracle_intra(p["q"], p["k"], p["g"], p["beta"], 0.4, c["slots"], BT)
    Tm, W, U = oracle_solve(Mkk, p["k"], p["v"], p["g"], p["beta"], c["slots"], BT)
    MqkTb, Kb = oracle_x_form(Mqk, Kend, Tm, p["beta"], c["slots"], BT)
    u = used(c["slots"])
    folded = c["opts"].use_qk_l2norm and prepare.anchored_path_usable(c["opts"])
    # the E form with Tm: the backward's recompute, on the inputs after the options (the l2norm as row factors)
    qp, kp, gp, bp, norms = transform_inputs(f["q"], f["k"], f["g"], f["beta"], c["A_log"], c["dt_bias"], c["opts"],
                                             torch.float32)  # fmt: skip
    with poison_outputs():
        e = prepare.chunk_prepare_recompute(qp, kp, f["v"], gp, bp, 0.4, c["slots"], prec, norms=norms)
    assert e.Mqk.dtype == torch.float32 and e.U is not None and e.Tm is not None
    for name, a, b in zip(("Mqk", "W", "U", "Qt", "Kend", "Tm"), (e.Mqk, e.W, e.U, e.Qt, e.Kend, e.Tm),
                          (Mqk, W, U, Qt, Kend, Tm)):  # fmt: skip
        assert_rel(a, b, tol, f"{name} (recompute)")
    assert_rel(e.Gl[u], Gl[u], 1e-5, "Gam_last")
    # the X form
    with poison_outputs():
        x = prepare.chunk_prepare(f["q"], f["k"], f["v"], f["g"], f["beta"], 0.4, c["slots"], c["A_log"],
                                  c["dt_bias"], c["opts"], prec)  # fmt: skip
    assert (x.Nrm is not None) == folded
    assert not hasattr(x, "U") and not hasattr(x, "Tm")  # the X form forms neither
    # with the l2norm folded, Qt and Kt come without their rows' factors: applied here
    nq, nk = (x.Nrm[0].T[:, :, None], x.Nrm[1].T[:, :, None]) if x.Nrm is not None else (1.0, 1.0)
    for name, a, b in zip(("Mqk Tb", "Kt", "Qt", "Kb"), (x.MqkTb, x.Kt * nk, x.Qt * nq, x.Kb), (MqkTb, kt(c), Qt, Kb)):
        assert_rel(a, b, tol, f"{name} (X form)")
    assert_rel(x.Gl[u], Gl[u], 1e-5, "Gam_last")


@pytest.mark.slow
@pytest.mark.parametrize("gates", ["reset", "strong"])
def test_block_pass_flag_loop_over_blocks_and_programs(gates: str, device: torch.device,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The block pass after the anchored kernel reads the flags FLAG_BLOCK at a time: with 2 per block, the 14
    (slot, head) items of the stage case (two empty slots) span 7 blocks over the 4 programs the launch uses off
    CUDA (on CUDA too, here). Log decays given as such (no in-kernel gate) flag slots 0, 1 and 4 with hard resets,
    slots 1 and 4 with strong decay, so program 0 walks two blocks and blocks hold two flagged items. Every output
    against the float64 oracle, poisoned first (a flagged chunk left undone stays NaN)."""
    monkeypatch.setattr(prepare, "FLAG_BLOCK", 2)
    assert prepare.persistent_programs(torch.device("cpu")) == 4
    if device.type == "cuda":  # the CPU's 4 programs, not one per SM: each program walks several blocks
        monkeypatch.setattr(prepare, "persistent_programs", lambda device: 4)
    test_stage_prepare(gates, "l2norm", 1e-5, device)


def test_kernels_compile_for_sm90() -> None:
    """The fused prepare kernels lower for sm_90, as the forward and the backward's recompute launch them
    (``tests/triton/sm90.py``)."""
    check_compiles("chunk.prepare")
