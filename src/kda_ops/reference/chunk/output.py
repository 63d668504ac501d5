"""Stage 5, the outputs: ``O = Qt S + Mqk E`` per chunk slot, ``S = Hin`` the state entering it (``docs/math.md``,
"The chunkwise form"). The oracle of :mod:`kda_ops.triton.chunk.output`.
"""

from __future__ import annotations

from torch import Tensor

from kda_ops.reference.chunk.common import gather, scatter, slot_index
from kda_ops.varlen import ChunkSlots


def output(Qt: Tensor, Mqk: Tensor, Hin: Tensor, E: Tensor, slots: ChunkSlots, C: int) -> Tensor:
    """``o [T, HV, V] = Qt S + Mqk E`` per slot, ``S = Hin`` the state entering it."""
    T = Qt.shape[0]
    index = slot_index(slots, C, T)
    Qc, Mc, Ec = (gather(x, index) for x in (Qt, Mqk, E))
    return scatter(Qc @ Hin + Mc @ Ec, index, T)


__all__ = ["output"]
