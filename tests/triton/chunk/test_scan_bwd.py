"""``kda_ops.triton.chunk.scan_bwd``: the backward's reverse scan (``dE``, ``dS'``, ``dh0``), fed the float64
oracle's forward factors, against its oracle (``kda_ops.reference.chunk.scan_bwd``), with each value tile, under
the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.reference.chunk.scan_bwd import scan_bwd as oracle_scan_bwd  # noqa: E402
from kda_ops.testing import assert_rel  # noqa: E402
from kda_ops.triton.chunk.scan_bwd import chunk_bwd_scan  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from kda_ops.triton.launch import force_forms  # noqa: E402
from tests.cases import CU_BWD, CU_SPLIT  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS, bwd_precisions, bwd_stage_case, f32, used  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [*OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]


# (gates, value tile, with dht, segments per sequence, packed batch)
SCANS = [("normal", None, True, None, CU_BWD), ("reset", 16, False, None, CU_BWD), ("normal", None, True, 3, CU_SPLIT),
         ("normal", 16, False, 4, CU_SPLIT), ("reset", None, True, 2, CU_BWD)]  # fmt: skip


@pytest.mark.parametrize(("gates", "tiles", "with_dht", "segments", "cu"), SCANS,
                         ids=[f"{g}-{t}-{d}-{s}-{len(c)}" for g, t, d, s, c in SCANS])  # fmt: skip
def test_stage_scan(gates: str, tiles: int | None, with_dht: bool, segments: int | None, cu: list[int],
                    device: torch.device) -> None:  # fmt: skip
    """The reverse scan alone, plain or split into ``segments`` per sequence (the split: each segment's map from a
    zero gradient, combined from the last, each segment finished from the gradient leaving it)."""
    c = bwd_stage_case(gates, V=24, device=device, cu_seqlens=cu)
    prec, _ = bwd_precisions(device)
    dht = c["dht"] if with_dht else None
    dO, Mqk, Qt, Kend, W, Gl = f32(c, "dO", "Mqk", "Qt", "Kend", "W", "Gl")
    with force_forms(scan_block_v=tiles, scan_segments=segments):
        # with the chunk slots, the off-chain term Mqk^T dO is formed by a pass of its own before the scan
        dE, dSp, dh0 = chunk_bwd_scan(dO, Mqk, Qt, Kend, W, Gl, None if dht is None else dht.float(), c["cu"], prec,
                                      slots=c["slots"])  # fmt: skip
        ref = oracle_scan_bwd(c["dO"], c["Mqk"], c["Qt"], c["Kend"], c["W"], c["Gl"], dht, c["slots"], BT, c["N"])
        u = used(c["slots"])
        assert dh0 is not None
        assert_rel(dE, ref[0], 1e-5, "dE")
        assert_rel(dSp[u], ref[1][u], 1e-5, "dS'")
        assert_rel(dh0, ref[2], 1e-5, "dh0")
        if with_dht:  # the empty sequence passes the final-state gradient through
            torch.testing.assert_close(dh0[1], dht[1].float())
        # dS' stored in bf16 (the driver's choice for bf16 inputs): one rounding of the same values (within one
        # bf16 ulp: the interpreter truncates where the GPU rounds to nearest), and the scan's carried dS (so dE,
        # dh0) untouched
        dE16, dSp16, dh016 = chunk_bwd_scan(dO, Mqk, Qt, Kend, W, Gl, None if dht is None else dht.float(), c["cu"],
                                            prec, dsp_dtype=torch.bfloat16, slots=c["slots"])  # fmt: skip
        # without the slots the step forms Mqk^T dO itself
        dE1, dSp1, dh01 = chunk_bwd_scan(dO, Mqk, Qt, Kend, W, Gl, None if dht is None else dht.float(), c["cu"], prec)
        assert dh01 is not None
        for got, want, name in ((dE1, ref[0], "dE"), (dSp1[u], ref[1][u], "dS'"), (dh01, ref[2], "dh0")):
            assert_rel(got, want, 1e-5, name)
    assert dSp16.dtype == torch.bfloat16 and dE16.dtype == torch.float32
    torch.testing.assert_close(dSp16[u].float(), dSp[u], rtol=2.0**-7, atol=1e-30)
    assert torch.equal(dE16, dE) and dh016 is not None and torch.equal(dh016, dh0)


def test_kernels_compile_for_sm90() -> None:
    """The reverse scan lowers for sm_90 as the backward launches it, within the backward's spill bound
    (``tests/triton/sm90.py``)."""
    check_compiles("chunk.scan_bwd")
