"""A pool of states read and written at slot indices: what the serving ops of both schedules share.

Sequence ``n`` starts from ``state_pool[state_indices[n]]`` and its final state is written back there; an index
outside ``[0, S)`` (-1 by convention) marks a padding sequence: it starts from zero, its output rows are zeros and
the pool is not touched. Nothing is read on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor


def read_slots(state_pool: Tensor, state_indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(h0, slot, valid)``: each sequence's state from its slot (zeros for padding), its slot clamped into the
    pool, and whether it is a real one."""
    idx = state_indices.to(torch.int64)
    valid = (idx >= 0) & (idx < state_pool.shape[0])
    slot = torch.where(valid, idx, torch.zeros_like(idx))
    if state_pool.shape[0] == 0:  # no slot at all: every sequence is padding
        return state_pool.new_zeros(idx.shape[0], *state_pool.shape[1:]), slot, valid
    h0 = torch.where(valid[:, None, None, None], state_pool.index_select(0, slot), 0.0)
    return h0, slot, valid


def write_slots(state_pool: Tensor, slot: Tensor, valid: Tensor, final: Tensor) -> None:
    """Each real sequence's ``final`` state into its slot, in place, rounded once to the pool's dtype. One sequence
    at a time: a padding sequence rewrites its (clamped) slot with that slot's current value, so it can never undo
    the update of a real sequence that shares the slot."""
    final = final.to(state_pool.dtype)
    for n in range(slot.shape[0] if state_pool.shape[0] else 0):
        cur = state_pool.index_select(0, slot[n : n + 1])
        state_pool.index_copy_(0, slot[n : n + 1], torch.where(valid[n], final[n : n + 1], cur))


__all__ = ["read_slots", "write_slots"]
