"""The recurrent schedule in plain PyTorch, token by token, without reading tensor values on the host; and the
serving step on a state pool. Mirrors :mod:`kda_ops.triton.recurrent.forward`.

:func:`recurrent_fwd` is the CPU kernel of ``torch.ops.kda.recurrent``: the recurrence of ``docs/math.md`` ("The
recurrence") per token. Variable-length batches reset the state at each sequence's first token from flags built on
the device, so the same code runs inside compiled graphs and CUDA graphs.

:func:`recurrent_update` is the CPU kernel of ``torch.ops.kda.recurrent_update_``: read states from a pool, run
the recurrence, write them back in place. Sequence ``n`` starts from ``state_pool[state_indices[n]]`` and its final
state is written back there; an index outside ``[0, S)`` (-1 by convention) marks a padding sequence: its output
rows are zeros and the pool is not touched. Nothing is read on the host.

The backward of both is the chunkwise analytic backward, :func:`kda_ops.reference.chunk.backward.chunk_bwd` (the
two schedules compute the same function).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.common import Options, state_dtype, transposed
from kda_ops.reference.inputs import transform_inputs
from kda_ops.reference.threads import loop_threads
from kda_ops.varlen import sanitize_cu_seqlens


def recurrent_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """Returns ``o [B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` (``(0,)`` when not asked).
    With ``opts.state_v_first`` the initial and final states are ``[N, HV, V, K]``: transposed (copies) here, at
    the oracle's boundary, so that the recurrence below is the same computation in either layout."""
    if opts.state_v_first and initial_state is not None:
        initial_state = transposed(initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = state_dtype(v)
    qp, kp, gp, bp = transform_inputs(q, k, g, beta, A_log, dt_bias, opts, dtype)
    qp = qp.repeat_interleave(HV // H, dim=2) * scale
    kp = kp.repeat_interleave(HV // H, dim=2)
    vp = v.to(dtype)
    dev = v.device
    t_idx = torch.arange(T, device=dev)
    if cu_seqlens is None:
        N = B
        seq = torch.arange(B, device=dev)[:, None].expand(B, T)
        start = (t_idx == 0)[None].expand(B, T)
        end = (t_idx == T - 1)[None].expand(B, T)
        valid = torch.ones(B, T, dtype=torch.bool, device=dev)
    else:
        cu = sanitize_cu_seqlens(cu_seqlens, T)
        N = cu.shape[0] - 1
        s = torch.searchsorted(cu[1:], t_idx, right=True).clamp(max=N - 1)
        seq, start, end = s[None], (t_idx == cu[s])[None], (t_idx == cu[s + 1] - 1)[None]
        valid = ((t_idx >= cu[0]) & (t_idx < cu[N]))[None]
    h0 = torch.zeros(N, HV, K, V, dtype=dtype, device=dev) if initial_state is None else initial_state.to(dtype)
    # one spare row at index N takes the writes of tokens that end no sequence
    finals = torch.cat([h0, h0.new_zeros(1, HV, K, V)])
    gp = gp * valid[..., None, None]
    bp = bp * valid[..., None]
    S = h0.new_zeros(B, HV, K, V)
    o = torch.empty(B, T, HV, V, dtype=dtype, device=dev)
    with loop_threads(S.numel()):
        for t in range(T):
            S = torch.where(start[:, t, None, None, None], h0[seq[:, t]], S)
            S = S * gp[:, t].exp().unsqueeze(-1)
            prediction = torch.einsum("bhkv,bhk->bhv", S, kp[:, t])
            residual = bp[:, t].unsqueeze(-1) * (vp[:, t] - prediction)
            S = S + torch.einsum("bhk,bhv->bhkv", kp[:, t], residual)
            o[:, t] = torch.einsum("bhk,bhkv->bhv", qp[:, t], S) * valid[:, t, None, None]
            finals = finals.index_copy(0, torch.where(end[:, t] & valid[:, t], seq[:, t], N), S)
    final = finals[:N].float() if dtype != torch.float64 else finals[:N]
    if not output_final_state:
        final = final.new_empty(0)
    elif opts.state_v_first:
        final = transposed(final)
    return o.to(v.dtype), final


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
    """Returns ``o [B, T, HV, V]`` (v's dtype); updates ``state_pool [S, HV, K, V]`` (``[S, HV, V, K]`` with
    ``opts.state_v_first``) at ``state_indices [N]``."""
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


__all__ = ["recurrent_fwd", "recurrent_update"]
