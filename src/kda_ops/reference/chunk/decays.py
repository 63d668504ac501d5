"""Stage 1, the chunk-local cumulative log decay: ``Gam_i = sum_{j <= i} g_j`` within each chunk and its last row
``Gam_last`` (``docs/math.md``, "The chunkwise form"). The oracle of :mod:`kda_ops.triton.chunk.decays`.
"""

from __future__ import annotations

from torch import Tensor

from kda_ops.reference.chunk.common import chunk_local_cumsum, gather, scatter, slot_index
from kda_ops.varlen import ChunkSlots


def decays(g: Tensor, slots: ChunkSlots, C: int) -> tuple[Tensor, Tensor]:
    """``Gam [T, HV, K]`` (chunk-local cumulative log decay) and ``Gam_last [NC, HV, K]`` from the log decay ``g``."""
    index = slot_index(slots, C, g.shape[0])
    Gam = chunk_local_cumsum(gather(g, index))
    return scatter(Gam, index, g.shape[0]), Gam[..., -1, :]


__all__ = ["decays"]
