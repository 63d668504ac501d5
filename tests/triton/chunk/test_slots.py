"""``kda_ops.triton.chunk.slots``: the chunk-slot map of the Triton drivers against ``kda_ops.varlen.chunk_map``,
under the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.triton.chunk.slots import slot_map  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from kda_ops.varlen import chunk_map  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_path")


@pytest.mark.parametrize(("B", "T"), [(1, 1), (1, 64), (2, 63), (3, 65), (7, 130), (2, 1000), (3, 40000)])
def test_dense_slot_map_equals_the_torch_map(B: int, T: int, device: torch.device) -> None:
    """The one-launch map of a dense batch (several programs at T = 40000) equals ``varlen.chunk_map``'s, and with
    ``cu_seqlens`` the drivers take ``varlen.chunk_map`` itself."""
    got = slot_map(None, B, T, device)
    ref = chunk_map(None, B, T, BT, device)
    for name in ("cu", "start", "count", "offset"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    cu = torch.tensor([0, 5, 5, B * T], device=device)
    got = slot_map(cu, B, T, device)
    ref = chunk_map(cu, B, T, BT, device)
    assert all(torch.equal(getattr(got, n), getattr(ref, n)) for n in ("cu", "start", "count", "offset"))


def test_kernels_compile_for_sm90() -> None:
    """The dense map kernel lowers for sm_90 (``tests/triton/sm90.py``)."""
    check_compiles("chunk.slots")
