"""The serving step in plain PyTorch: read states from a pool, run the recurrence, write them back in place.

The CPU kernel of ``torch.ops.kda.recurrent_update_``. Sequence ``n`` starts from ``state_pool[state_indices[n]]``
and its final state is written back there; an index outside ``[0, S)`` (-1 by convention) marks a padding
sequence: its output rows are zeros and the pool is not touched. Nothing is read on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.common import Options
from kda_ops.reference.recurrent import recurrent_fwd
from kda_ops.varlen import sanitize_cu_seqlens


def recurrent_update(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float,
    cu_seqlens: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
) -> Tensor:
    """Returns ``o [B, T, HV, V]`` (v's dtype); updates ``state_pool [S, HV, K, V]`` at ``state_indices [N]``."""
    B, T = q.shape[:2]
    S = state_pool.shape[0]
    idx = state_indices.to(torch.int64)
    valid = (idx >= 0) & (idx < S)
    slot = torch.where(valid, idx, torch.zeros_like(idx))
    h0 = state_pool.index_select(0, slot)
    o, final = recurrent_fwd(q, k, v, g, beta, scale, h0, cu_seqlens, A_log, dt_bias, opts, True)
    # zero the output rows of padding sequences
    if cu_seqlens is None:
        keep = valid[:, None, None, None]
    else:
        cu = sanitize_cu_seqlens(cu_seqlens, T)
        N = cu.shape[0] - 1
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=q.device), right=True).clamp(max=max(N - 1, 0))
        keep = valid[seq][None, :, None, None]
    o = torch.where(keep, o, torch.zeros((), dtype=o.dtype, device=o.device))
    # One sequence at a time: a padding sequence rewrites its (clamped) slot with that slot's current value, so
    # it can never undo the update of a valid sequence that shares the slot.
    final = final.to(state_pool.dtype)
    for n in range(slot.shape[0]):
        cur = state_pool.index_select(0, slot[n : n + 1])
        state_pool.index_copy_(0, slot[n : n + 1], torch.where(valid[n], final[n : n + 1], cur))
    return o
