"""Backward stage 1, the reverse state-gradient scan: the one sequential part of the backward. The gradient of the
scan of ``docs/math.md`` ("The chunkwise form"), chunk after chunk from each sequence's last::

    dS' = dS of the next chunk (the final state's gradient after the last)
    dE  = Kend dS' + Mqk^T dO
    dS  = diag(exp(Gam_last)) dS' + Qt^T dO - W^T dE       (the first chunk's is dh0)

The oracle of :mod:`kda_ops.triton.chunk.scan_bwd`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.reference.chunk.common import gather, scatter, slot_index, stack_slots
from kda_ops.reference.threads import loop_threads
from kda_ops.varlen import ChunkSlots


def scan_bwd(
    dO: Tensor, Mqk: Tensor, Qt: Tensor, Kend: Tensor, W: Tensor, Gl: Tensor, dht: Tensor | None, slots: ChunkSlots,
    C: int, N: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dE [T, HV, V], dS' [NC, HV, K, V], dh0 [N, HV, K, V])``: the reverse scan over each sequence's slots."""
    T, HV, K = W.shape
    V = dO.shape[2]
    index = slot_index(slots, C, T)
    dOc, Mc, Qc, Kc, Wc = (gather(x, index) for x in (dO, Mqk, Qt, Kend, W))
    dht_p = W.new_zeros(N + 1, HV, K, V)
    if dht is not None:
        dht_p[:N] = dht
    dS = W.new_zeros(HV, K, V)
    dSps, dEs, dSins = [], [], []
    with loop_threads(dS.numel()):
        for c in reversed(range(index.shape[0])):
            dSp = torch.where(slots.last[c], dht_p[slots.seq[c]], dS)
            dE = Kc[c] @ dSp + Mc[c].transpose(-1, -2) @ dOc[c]
            dS = Gl[c].exp().unsqueeze(-1) * dSp + Qc[c].transpose(-1, -2) @ dOc[c] - Wc[c].transpose(-1, -2) @ dE
            dSps.append(dSp)
            dEs.append(dE)
            dSins.append(dS)
    dSp_all, dSin_all = (stack_slots(x[::-1], dS.shape, dS) for x in (dSps, dSins))
    dE_all = stack_slots(dEs[::-1], (HV, C, V), dS)
    dh0 = dht_p.index_copy(0, torch.where(slots.first, slots.seq, N), dSin_all)[:N]
    return scatter(dE_all, index, T), dSp_all, dh0


__all__ = ["scan_bwd"]
