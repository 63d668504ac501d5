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
from kda_ops.reference.pool import read_slots, write_slots
from kda_ops.reference.threads import loop_threads
from kda_ops.varlen import sanitize_cu_seqlens, zero_padding_rows


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
    num_accepted_tokens: Tensor | None = None,
    write_states: bool = True,
) -> Tensor:
    """Returns ``o [B, T, HV, V]`` (v's dtype); updates ``state_pool [S, HV, K, V]`` (``[S, HV, V, K]`` with
    ``opts.state_v_first``) at ``state_indices [N]`` (nothing with ``write_states=False``), or per token at
    ``state_indices [N, T_spec]`` (:func:`speculative_update`)."""
    if state_indices.dim() == 2:
        return speculative_update(q, k, v, g, beta, state_pool, state_indices, scale, cu_seqlens, A_log, dt_bias,
                                  opts, num_accepted_tokens, write_states)  # fmt: skip
    h0, slot, valid = read_slots(state_pool, state_indices)
    o, final = recurrent_fwd(q, k, v, g, beta, scale, h0, cu_seqlens, A_log, dt_bias, opts, True)
    if write_states:
        write_slots(state_pool, slot, valid, final)
    return zero_padding_rows(o, valid, cu_seqlens)


def speculative_update(
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
    num_accepted_tokens: Tensor | None,
    write_states: bool,
) -> Tensor:
    """The speculative verify step: sequence ``n`` starts from slot ``state_indices[n, a_n - 1]`` (``a_n =
    num_accepted_tokens[n]``; column 0 without it) and the state after its ``t``-th token goes to slot
    ``state_indices[n, t]`` (none past column ``T_spec - 1``, none for a slot outside ``[0, S)``, none at all
    without ``write_states``). A sequence whose first slot or ``a_n`` is out of range is padding: zero output rows.
    Every initial state is read before any is written. Token by token through :func:`recurrent_fwd`, reading the
    slots on the host: the CPU kernel (the Triton kernel reads them on the device)."""
    B, T = q.shape[:2]
    S = state_pool.shape[0]
    N, W = state_indices.shape
    idx = state_indices.to(torch.int64)
    col = torch.zeros_like(idx[:, 0]) if num_accepted_tokens is None else num_accepted_tokens.to(torch.int64) - 1
    first = idx.gather(1, col.clamp(0, max(W - 1, 0))[:, None])[:, 0] if W > 0 else torch.full_like(col, -1)
    valid = (col >= 0) & (col < W) & (first >= 0) & (first < S)
    h0 = state_pool.index_select(0, torch.where(valid, first, torch.zeros_like(first)))
    o = torch.zeros(*v.shape[:3], v.shape[3], dtype=v.dtype, device=v.device)
    if cu_seqlens is None:
        rows = [(n, 0, T) for n in range(N)]
    else:
        cu = sanitize_cu_seqlens(cu_seqlens, T).tolist()  # sync-ok: the CPU kernel of the op
        rows = [(0, cu[n], cu[n + 1]) for n in range(N)]
    slots = idx.tolist()  # sync-ok: as above
    for n, ok in enumerate(valid.tolist()):  # sync-ok: as above
        if not ok:
            continue
        b, bos, eos = rows[n]
        h = h0[n : n + 1]
        for t in range(eos - bos):
            tok = slice(bos + t, bos + t + 1)
            o_t, h = recurrent_fwd(q[b : b + 1, tok], k[b : b + 1, tok], v[b : b + 1, tok], g[b : b + 1, tok],
                                   beta[b : b + 1, tok], scale, h, None, A_log, dt_bias, opts, True)  # fmt: skip
            o[b, bos + t] = o_t[0, 0]
            if write_states and t < W and 0 <= slots[n][t] < S:
                state_pool[slots[n][t]] = h[0].to(state_pool.dtype)
    return o


__all__ = ["recurrent_fwd", "recurrent_update", "speculative_update"]
