"""``kda_ops.triton.chunk.intra``: the chunk's ``Mqk``, ``Mkk``, ``Qt``, ``Kend``, ``Kt`` (the stage kernel
``chunk_intra`` built on its device helpers, both its anchored and its block path) against the float64 oracle
(``kda_ops.reference.chunk.intra``), under the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.reference.chunk.intra import intra as oracle_intra  # noqa: E402
from kda_ops.testing import assert_rel  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from tests.triton.chunk import stage_kernels  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS, kt, stage_case, stage_precision, used  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [*OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]


@pytest.mark.parametrize(
    ("dtype", "gates", "option"),
    [
        (torch.float32, "normal", "plain"),
        (torch.float32, "reset", "l2norm"),
        (torch.float32, "first_row", "plain"),
        (torch.float32, "zero", "beta_sigmoid"),
        (torch.float32, "strong", "all"),
        (torch.float16, "normal", "neg_eigval"),
    ],
)
@pytest.mark.slow
def test_stage_intra(dtype: torch.dtype, gates: str, option: str, device: torch.device) -> None:
    c = stage_case(dtype, gates, option, device=device)
    f, p = c["flat"], c["p"]
    prec = stage_precision(device, dtype)
    got = stage_kernels.chunk_intra(f["q"], f["k"], f["g"], f["beta"], 0.4, c["slots"], c["A_log"], c["dt_bias"],
                                    c["opts"], prec)  # fmt: skip
    ref = oracle_intra(p["q"], p["k"], p["g"], p["beta"], 0.4, c["slots"], BT)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp16: Qt, Kend and Kt are stored in bf16
    u = used(c["slots"])
    for name, a, b in zip(("Mqk", "Mkk", "Qt", "Kend", "Kt"), got[:5], (*ref[:4], kt(c))):
        assert_rel(a, b, 1e-5 if name.startswith("M") else tol, name)
    assert_rel(got[5][u], ref[4][u], 1e-5, "Gam_last")  # the gate in fp32


@pytest.mark.parametrize(
    ("span", "names", "tol"),
    [
        # the factored diagonal blocks switched off: the exact pairwise path
        ("FACTOR_SPAN", ("Mqk", "Mkk"), 1e-6),
        # every chunk flagged for the second (block-path) pass: two fp32 factorings of the same decays
        ("ANCHOR_SPAN", ("Mqk", "Mkk", "Qt", "Kend", "Kt"), 1e-5),
    ],
    ids=["pairwise_path_equals_factored", "block_pass_equals_anchored_pass"],
)
@pytest.mark.slow
def test_stage_intra_paths_agree(span: str, names: tuple[str, ...], tol: float, device: torch.device,
                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Switching a factoring off (its span limit below 0) sends the chunks down the other path: same matrices."""
    c = stage_case(torch.float32, "normal", "l2norm", device=device)
    f = c["flat"]
    args = (f["q"], f["k"], f["g"], f["beta"], 0.4, c["slots"], c["A_log"], c["dt_bias"], c["opts"],
            stage_precision(device))  # fmt: skip
    default = stage_kernels.chunk_intra(*args)
    monkeypatch.setattr(stage_kernels, span, -1.0)
    other = stage_kernels.chunk_intra(*args)
    for name, a, b in zip(names, default, other):
        assert_rel(a, b, tol, name)


def test_kernels_compile_for_sm90() -> None:
    """The intra stage kernel (on this module's device helpers) lowers for sm_90 (``tests/triton/sm90.py``)."""
    check_compiles("chunk.intra")
