"""Context parallelism: one sequence (or a packed row of them) split along the token axis over the ranks of a
``torch.distributed`` group, exact, forward and backward (``docs/distributed.md``; the math is ``docs/math.md``,
"Segments: the split scan").

Rank ``r`` holds the contiguous slice of tokens after those of ranks ``0 .. r-1``. Per value head, the slice maps the
state entering it affinely, ``S_out = M S_in + B``. Every rank runs :func:`kda_ops.chunk_kda` once on its slice,
with ``K`` extra value columns that start from the identity and carry no value: their final state is ``M``, their
output is ``P_t`` with ``o_t(S_in) = o_t(0) + P_t S_in``. One all-gather shares every rank's ``(M, B)``; each rank
folds the summaries before its own into its true incoming state and adds ``P S_in`` to its outputs. Autograd runs
the same in reverse: the all-gather's backward is a reduce-scatter, so the gradient of a state flows from the ranks
that used it to the rank that made it.

No value is read on the host: the slice offsets are an all-gather of the slice lengths, and the local ``cu_seqlens``
are the global ones shifted and clamped on the device. Under ``torch.compile(fullgraph=True)`` the all-gather is
``torch.distributed``'s functional one, which traces; in eager mode it is ``all_gather_into_tensor`` in an autograd
function (:class:`_AllGather`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import Tensor

from kda_ops.api import MAX_HEAD_DIM, _check_cu_seqlens_values, check_call
from kda_ops.api import chunk_kda as _chunk_kda
from kda_ops.common import num_sequences, state_dtype, transposed
from kda_ops.reference.segments import segment_states

# the autograd all-gather's name since torch 2.12, and before
_ALL_GATHER = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd


class _AllGather(torch.autograd.Function):
    """``[W, *x.shape]`` by ``all_gather_into_tensor``, the backward a ``reduce_scatter_tensor``: the eager form of
    :func:`_gather`. The functional all-gather over gloo (torch 2.13) aborts a rank at interpreter exit, after its
    work, in 2 of 24 runs of a script of nothing else; the torchrun example through this form in 0 of 24."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.numel(),))
        dist.all_gather_into_tensor(out, x.contiguous().view(-1), group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        dx = grad.new_empty((grad[0].numel(),))
        dist.reduce_scatter_tensor(dx, grad.contiguous().view(-1), group=ctx.group)
        return dx.view(grad.shape[1:]), None


def _gather(x: Tensor, group: Any) -> Tensor:
    """``[W, *x.shape]``: every rank's ``x``, in rank order; differentiable (the backward is a reduce-scatter)."""
    if not torch.compiler.is_compiling():
        gathered_eager: Tensor = _AllGather.apply(x, group)  # type: ignore[no-untyped-call]
        return gathered_eager
    out = _ALL_GATHER(x.unsqueeze(0).contiguous(), 0, group)
    gathered: Tensor = fc.wait_tensor(out) if isinstance(out, fc.AsyncCollectiveTensor) else out
    return gathered


def _slice_offset(T: int, rank: int, group: Any, cu_seqlens: Tensor) -> Tensor:
    """The global position of this rank's first token: the sum of the slice lengths of the ranks before it. A CPU
    ``cu_seqlens`` is checked against the whole row in eager mode (reading it does not synchronise a device)."""
    lengths = _gather(torch.full((1,), T, dtype=torch.int64, device=cu_seqlens.device), group).view(-1)
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_cu_seqlens_values(cu_seqlens, int(lengths.sum()))  # sync-ok: CPU tensors, eager only
    return lengths[:rank].sum()


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    group: Any = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    recompute_in_backward: bool = False,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`kda_ops.chunk_kda` over a sequence split along ``T`` across the ranks of ``group`` (default: the
    world): the result equals ``chunk_kda`` on the whole sequence, each rank holding its slice of ``o``.

    Every rank passes its slice of ``q, k, v, g, beta`` (``[B, T_local, ...]``; slices may differ in length, and may
    be empty) in rank order, and the same options. With packed sequences (B = 1) every rank passes the same global
    ``cu_seqlens`` ``[N + 1]`` of the whole row: a sequence may start and end on any rank. ``initial_state``
    ``[N, HV, K, V]`` is given on every rank or on none (a replicated tensor, as ``cu_seqlens`` is): the first rank's
    copy is the one used, and its gradient comes back there only.
    With ``output_final_state`` every rank returns the final states of all N sequences (the same tensor), whose
    gradient, from any rank, flows back to the ranks that hold the sequence. Options as :func:`kda_ops.chunk_kda`;
    ``return_intermediate_states`` is not offered.

    Raises:
        TypeError, ValueError: as :func:`kda_ops.chunk_kda`, and where torch.distributed is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call torch.distributed.init_process_group)")
    group = dist.group.WORLD if group is None else group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # as chunk_kda checks them, on the slice, before it is widened by K columns; the values of cu_seqlens belong to
    # the whole row: checked below, against the slices' lengths
    check_call(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        state_v_first=state_v_first, cu_seqlens_values=False, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, recompute_in_backward=recompute_in_backward,
    )  # fmt: skip
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = num_sequences(q, cu_seqlens)
    if initial_state is not None and state_v_first:
        initial_state = transposed(initial_state)
    dtype = state_dtype(v)
    options: dict[str, Any] = dict(
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, recompute_in_backward=recompute_in_backward,
    )  # fmt: skip

    # Which sequences enter this slice with a state made on earlier ranks (their columns start from the identity),
    # and which start in it (from initial_state, which the packed layout needs on every rank).
    local_cu = None
    if cu_seqlens is None:
        carried = torch.full((N,), rank > 0, dtype=torch.bool, device=q.device)
        h0 = None if initial_state is None or rank > 0 else initial_state.to(dtype)
    else:
        start = _slice_offset(T, rank, group, cu_seqlens)
        local_cu = (cu_seqlens - start).clamp(0, T).to(cu_seqlens.dtype)
        carried = cu_seqlens[:-1] < start
        # the first rank's copy, on every rank (sequences may start anywhere; its gradient returns to it), kept for
        # the sequences that start in this slice
        if initial_state is not None:
            h0 = _gather(initial_state.to(dtype), group)[0] * (~carried).to(dtype)[:, None, None, None]
        else:
            h0 = None

    # The slice from the states it can know, in K + V columns: [v | 0] from [h0 | I] (the identity on carried
    # sequences only), in one call when the columns fit a head, else two.
    eye = torch.eye(K, dtype=dtype, device=q.device).expand(N, HV, K, K) * carried.to(dtype)[:, None, None, None]
    value_init = h0 if h0 is not None else q.new_zeros((N, HV, K, V), dtype=dtype)
    zeros = v.new_zeros((B, T, HV, K))
    if V + K <= MAX_HEAD_DIM:
        o_all, final = _chunk_kda(
            q, k, torch.cat([v, zeros], -1), g, beta, initial_state=torch.cat([value_init, eye], -1),
            output_final_state=True, cu_seqlens=local_cu, **options,
        )  # fmt: skip
        assert final is not None
        o, P, Bmap, Mmap = o_all[..., :V], o_all[..., V:], final[..., :V], final[..., V:]
    else:
        o, Bmap = _chunk_kda(q, k, v, g, beta, initial_state=value_init, output_final_state=True,
                             cu_seqlens=local_cu, **options)  # fmt: skip
        P, Mmap = _chunk_kda(q, k, zeros, g, beta, initial_state=eye, output_final_state=True,
                             cu_seqlens=local_cu, **options)  # fmt: skip
        assert Bmap is not None and Mmap is not None

    # One all-gather of the summaries, then every rank folds them in rank order: entering[r] is the state that
    # reaches rank r's slice, entering[world] the final states.
    summaries = _gather(torch.cat([Mmap, Bmap], -1), group)
    entering = segment_states([(s[..., :K], s[..., K:]) for s in summaries.unbind(0)], torch.zeros_like(Bmap))
    # the first rank folds nothing, but its outputs still hang on the all-gather: every rank's backward must run
    # the all-gather's reduce-scatter, or the ranks that do wait forever
    incoming = entering[rank] if rank > 0 else torch.where(torch.zeros((), dtype=torch.bool, device=q.device),
                                                           summaries[0, ..., K:], 0.0)  # fmt: skip
    # the sum in the state's precision, rounded once to the output's dtype
    if cu_seqlens is None:
        o = (o.to(dtype) + torch.einsum("bthk,bhkv->bthv", P.to(dtype), incoming)).to(o.dtype)
    else:
        # only the sequence in progress at the slice's start has carried tokens here: P is zero elsewhere
        n0 = (cu_seqlens[1:] <= start).sum().clamp(max=N - 1).view(1)
        o = (o.to(dtype) + torch.einsum("bthk,bhkv->bthv", P.to(dtype), incoming.index_select(0, n0))).to(o.dtype)
    if not output_final_state:
        return o, None
    final_states = entering[world]
    return o, transposed(final_states) if state_v_first else final_states


__all__ = ["chunk_kda"]
