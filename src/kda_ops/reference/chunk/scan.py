"""Stage 4, the inter-chunk state scan: the one sequential part of the forward (``docs/math.md``, "The chunkwise
form")::

    E  = U - W S                                   resolved errors
    S' = diag(exp(Gam_last)) S + Kend^T E          the state after the chunk

over each sequence's chunk slots, from its initial state. The oracle of :mod:`kda_ops.triton.chunk.scan`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.reference.chunk.common import gather, scatter, slot_index, stack_slots
from kda_ops.reference.threads import loop_threads
from kda_ops.varlen import ChunkSlots


def state_scan(
    W: Tensor, U: Tensor, Kend: Tensor, Gl: Tensor, h0: Tensor, slots: ChunkSlots
) -> tuple[Tensor, Tensor, Tensor]:
    """The one sequential part: the scan over chunk slots, resetting at each sequence's first chunk.

    ``W, Kend [NC, HV, C, K]``, ``U [NC, HV, C, V]``, ``Gl [NC, HV, K]``, ``h0 [N, HV, K, V]``. Returns the state
    entering each slot ``Hin [NC, HV, K, V]``, the resolved errors ``E [NC, HV, C, V]`` and the final states.
    """
    N, HV, K, V = h0.shape
    S = h0.new_zeros(HV, K, V)
    Hin, Es, Souts = [], [], []
    with loop_threads(S.numel()):
        for c in range(W.shape[0]):
            S = torch.where(slots.first[c], h0[slots.seq[c]], S)
            Hin.append(S)
            E = U[c] - W[c] @ S
            S = Gl[c].exp().unsqueeze(-1) * S + Kend[c].transpose(-1, -2) @ E
            Es.append(E)
            Souts.append(S)
    final = torch.cat([h0, h0.new_zeros(1, HV, K, V)])
    final = final.index_copy(0, torch.where(slots.last, slots.seq, N), stack_slots(Souts, S.shape, S))[:N]
    return stack_slots(Hin, S.shape, S), stack_slots(Es, U.shape[1:], U), final


def scan(
    W: Tensor, U: Tensor, Kend: Tensor, Gl: Tensor, h0: Tensor, slots: ChunkSlots, C: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(Hin [NC, HV, K, V], E [T, HV, V], final [N, HV, K, V])``: the scan ``E = U - W S``,
    ``S' = exp(Gam_last) S + Kend^T E`` over each sequence's slots, from ``h0``."""
    T = W.shape[0]
    index = slot_index(slots, C, T)
    Wc, Uc, Kc = (gather(x, index) for x in (W, U, Kend))
    Hin, E, final = state_scan(Wc, Uc, Kc, Gl, h0, slots)
    return Hin, scatter(E, index, T), final


__all__ = ["scan", "state_scan"]
