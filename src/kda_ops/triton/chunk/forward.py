"""The chunkwise KDA forward: the driver of the stage kernels (``docs/math.md``, "The chunkwise form").

Per value head, chunks of ``BT = 64`` tokens, incoming state ``S [K, V]``, with ``Tb = Tm diag(beta)`` for
``Tm = (I + Mkk)^-1`` and ``E = Tb X``::

    Gam, Mqk Tb, Kt = k exp(Gam), Qt, Kb = Tb^T Kend          stages 1-3, one program per chunk      (prepare)
    X  = V - Kt S,  S' = diag(exp(Gam_last)) S + Kb^T X        the scan over chunks                   (scan)
    O  = Qt S + (Mqk Tb) X                                     parallel over chunks                   (output)

:func:`chunk_fwd` is the kernel of ``torch.ops.kda.chunk`` (``Gam``, ``Mkk`` and ``Tm`` never leave the chip);
:func:`chunk_fwd_train` that of ``torch.ops.kda.chunk_train``: the same forward through the backward's recompute,
keeping the factors the backward reads.

Variable length: the flat token stream (a dense batch ``[B, T]`` is ``B`` sequences of ``T``) is split into a
static ``cdiv(B*T, BT) + N`` chunk slots built on the device from ``cu_seqlens``; nothing reads a value on the
host and nothing is allocated by value, so one compiled graph and one captured CUDA graph serve every
``cu_seqlens`` with the same ``T`` and ``N``. Call :func:`kda_ops.warmup` before a capture: it compiles every
kernel variant a call can pick.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.common import Options, chunk_states_dtype, forward_outputs, num_sequences, state_dtype, state_shape
from kda_ops.triton.chunk.inputs import transform_inputs
from kda_ops.triton.chunk.output import chunk_output
from kda_ops.triton.chunk.precision import Precision, precision_for
from kda_ops.triton.chunk.prepare import chunk_prepare
from kda_ops.triton.chunk.recompute import (
    chunk_bwd_recompute,
    clear_empty_slots,
    recompute_precision,
    recomputed_empty,
)
from kda_ops.triton.chunk.scan import chunk_state
from kda_ops.triton.chunk.slots import slot_map
from kda_ops.triton.chunk.tiles import BT
from kda_ops.triton.launch import contiguous, flat, poison
from kda_ops.varlen import ChunkMap, chunk_states, chunk_states_shape


def _opt(x: Tensor | None) -> Tensor | None:
    return None if x is None else contiguous(x)


def chunk_fwd(
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
    precision: Precision | None = None,
) -> tuple[Tensor, Tensor]:
    """``o [B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` fp32 (``(0,)`` when not asked);
    with ``opts.state_v_first`` the initial and final states are ``[N, HV, V, K]``.

    The signature of ``reference.chunk_fwd`` (chunk size fixed at 64); ``precision`` defaults to
    :func:`~kda_ops.triton.chunk.precision.precision_for` of v's dtype.
    """
    o, final, _ = _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts,
                           output_final_state, precision, states=False)  # fmt: skip
    return o, final


def _forward(
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
    precision: Precision | None,
    states: bool,
    pool: Tensor | None = None,
    state_indices: Tensor | None = None,
    checkpoints: tuple[Tensor, int] | None = None,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`chunk_fwd`'s outputs, and with ``states`` the state entering each chunk. With ``pool`` and
    ``state_indices`` (:func:`chunk_update`; ``initial_state`` None) the scan reads each sequence's initial state
    from its pool slot and writes its final state back there; the returned final state is then empty. ``valid [N]``
    (bool): the outputs of a sequence whose entry is False are zero."""
    B, T = q.shape[:2]
    v = contiguous(v)
    o, final = forward_outputs(q, v, cu_seqlens, output_final_state, opts.state_v_first)
    h0 = pool if pool is not None else None if initial_state is None else contiguous(initial_state.to(state_dtype(v)))
    packed = cu_seqlens is not None
    if B * T == 0:
        if pool is not None:
            return o, final, None
        final = final_without_tokens(final, h0, output_final_state)
        if not states:
            return o, final, None
        lead = chunk_states_shape(B, T, num_sequences(q, cu_seqlens), packed, BT)
        shape = state_shape(0, v.shape[2], q.shape[3], v.shape[3], opts.state_v_first)[1:]
        return o, final, v.new_zeros(*lead, *shape, dtype=chunk_states_dtype(v))
    p = precision or precision_for(v.dtype)
    slots = slot_map(cu_seqlens, B, T, v.device)
    cu = slots.cu
    poison(o, final)
    # stages 1-3, fused per chunk, in the X form: Gam; Mqk, Mkk, Qt, Kend; Tm = (I + Mkk)^-1; with
    # Tb = Tm diag(beta): Mqk Tb, Kt = k exp(Gam), Kb = Tb^T Kend (neither W = Tb Kt nor U = Tb V)
    vf = flat(v)
    f = chunk_prepare(
        q=flat(q), k=flat(k), v=vf, g=flat(g), beta=flat(beta), scale=scale, slots=slots, A_log=_opt(A_log),
        dt_bias=_opt(dt_bias), opts=opts, precision=p,
    )
    # stage 4: X = V - Kt S (E = U - W S = Tb X);  S' = exp(Gam_last) S + Kb^T X, keeping the state entering each chunk
    Hin, X = chunk_state(
        W=f.Kt, U=vf, Kend=f.Kb, Gl=f.Gl, h0=h0, cu=cu, precision=p,
        final=pool if pool is not None else final if output_final_state else None, offsets=slots.offset, norms=f.Nrm,
        x_form=True, state_v_first=opts.state_v_first, state_indices=state_indices, checkpoints=checkpoints,
    )
    # stage 5: O = Qt S + Mqk E = Qt S + (Mqk Tb) X, parallel over chunks
    chunk_output(
        Qt=f.Qt, Mqk=f.MqkTb, Hin=Hin, E=X, slots=slots, precision=p, out_dtype=o.dtype,
        out=o.view(B * T, *o.shape[2:]), norms=f.Nrm, keep=None if valid is None else slot_keep(slots, valid),
    )
    if not states:
        return o, final, None
    return o, final, chunk_states(Hin, slots.count, B, T, packed, BT, chunk_states_dtype(v), opts.state_v_first)


def chunk_update(
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
    checkpoint_every: int = 0,
    checkpoint_indices: Tensor | None = None,
) -> Tensor:
    """The kernel of ``kda::chunk_update_``: the chunkwise forward from and back into ``state_pool`` (``[S, HV, K,
    V]``, ``[S, HV, V, K]`` with ``opts.state_v_first``) at ``state_indices [N]``, in place, no gather or scatter
    copy; ``o`` with a padding sequence's rows (slot -1) zero (its state is neither read nor written). With
    ``checkpoint_indices [N, C]`` the scan also writes the state after every ``checkpoint_every`` tokens (a multiple
    of the chunk size) of sequence ``n`` to slot ``checkpoint_indices[n, m]``."""
    ckpt = None if checkpoint_indices is None else (checkpoint_indices, checkpoint_every)
    valid = (state_indices >= 0) & (state_indices < state_pool.shape[0])
    o, _, _ = _forward(q, k, v, g, beta, scale, None, cu_seqlens, A_log, dt_bias, opts, False, None, states=False,
                       pool=state_pool, state_indices=state_indices, checkpoints=ckpt, valid=valid)  # fmt: skip
    return o


def slot_keep(slots: ChunkMap, valid: Tensor) -> Tensor:
    """``valid [N]`` of the sequence owning each chunk slot, ``[NC]`` int32 (the output stage's ``keep``): a slot
    belongs to the last sequence whose first slot is at or before it (a sequence without chunks owns none)."""
    NC = slots.start.shape[0]
    seq = torch.searchsorted(slots.offset, torch.arange(NC, device=valid.device), right=True) - 1
    return valid[seq.clamp_(0, valid.shape[0] - 1)].to(torch.int32)


def chunk_fwd_states(
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
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`chunk_fwd` and the state entering each chunk (:func:`kda_ops.varlen.chunk_states`): the kernel of
    ``torch.ops.kda.chunk_states``, with the signature of ``reference.chunk_fwd_states``."""
    o, final, h = _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts,
                           output_final_state, None, states=True)  # fmt: skip
    assert h is not None
    return o, final, h


def final_without_tokens(final: Tensor, h0: Tensor | None, output_final_state: bool) -> Tensor:
    """The final state when there is no token at all: the initial state (or zeros)."""
    if output_final_state:
        if h0 is None:
            final.zero_()
        else:
            final.copy_(h0)
    return final




def chunk_fwd_train(
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
) -> tuple[Tensor, ...]:
    """The kernel of ``kda::chunk_train``: ``(o, final_state, Mqk, Qt, Kend, Gl, Tm, W, Hin, E, norms)``.

    The forward of a training step that keeps what the backward reads (``docs/architecture.md``, "Chunk backward:
    what is saved"): the backward's own recompute (:func:`~kda_ops.triton.chunk.recompute.chunk_bwd_recompute`: the
    prepared inputs, the fused prepare kernel with ``Tm`` stored, the scan keeping ``Hin`` and ``E``) and the output
    stage on its factors.
    ``norms`` is ``[2, B*T, H]`` with the l2norm in kernel, else ``(0,)``. Same ``o`` and final state as
    :func:`chunk_fwd` up to rounding (the factors are formed from prepared inputs).
    """
    B, T = q.shape[:2]
    dt = state_dtype(v)
    o, final = forward_outputs(q, v, cu_seqlens, output_final_state, opts.state_v_first)
    N = num_sequences(q, cu_seqlens)
    h0 = None if initial_state is None else contiguous(initial_state.to(dt))
    if B * T == 0:
        final = final_without_tokens(final, h0, output_final_state)
        kept = tuple(t.zero_() for t in recomputed_empty(q, v, N).tensors())  # only the N slots have elements
        norms_0 = q.new_empty(2, 0, q.shape[2], dtype=dt) if opts.use_qk_l2norm else q.new_empty(0)
        return (o, final, *kept, norms_0)
    qf, kf, vf, gf, bf = (flat(x) for x in (q, k, v, g, beta))
    qp, kp, gp, bp, norms = transform_inputs(qf, kf, gf, bf, A_log, dt_bias, opts, dt)
    slots = slot_map(cu_seqlens, B, T, v.device)
    rp = recompute_precision(v.dtype)
    poison(o, final)
    fw = chunk_bwd_recompute(
        q=qp, k=kp, v=vf, g=gp, beta=bp, scale=scale, h0=h0, cu=slots.cu, slots=slots, precision=rp,
        offsets=slots.offset, norms=norms, final=final if output_final_state else None,
        state_v_first=opts.state_v_first,
    )
    clear_empty_slots(fw, slots)
    chunk_output(
        Qt=fw.Qt, Mqk=fw.Mqk, Hin=fw.Hin, E=fw.E, slots=slots, precision=rp, out_dtype=o.dtype,
        out=o.view(B * T, *o.shape[2:]),
    )
    return (o, final, *fw.tensors(), q.new_empty(0) if norms is None else norms)


__all__ = ["chunk_fwd", "chunk_fwd_states", "chunk_fwd_train", "chunk_update", "final_without_tokens"]
