"""The chunkwise forward, all stages in one pass: the CPU kernel of ``torch.ops.kda.chunk`` and the recompute of
:mod:`.backward`. Mirrors the driver :mod:`kda_ops.triton.chunk.forward`.

Every formula of ``docs/math.md`` ("The chunkwise form") in order, on the chunk slots of the flat token stream:
the decays, ``Mqk`` and ``Mkk`` (:func:`~kda_ops.reference.chunk.intra.intra_chunk`), ``Tm`` and the WY factors
(:mod:`.solve`), the state scan (:func:`~kda_ops.reference.chunk.scan.state_scan`), then ``O = Qt S + Mqk E``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kda_ops.common import Options, chunk_states_dtype, state_dtype, transposed
from kda_ops.reference.chunk.common import (
    DEFAULT_CHUNK_SIZE,
    chunk_local_cumsum,
    gather,
    scatter,
    slot_index,
)
from kda_ops.reference.chunk.intra import intra_chunk
from kda_ops.reference.chunk.prepare import prepare_flat
from kda_ops.reference.chunk.scan import state_scan
from kda_ops.reference.chunk.solve import solve_unit_lower, wy_factors
from kda_ops.reference.pool import read_slots, write_slots
from kda_ops.varlen import ChunkSlots, chunk_slots, chunk_states, flat_cu_seqlens, zero_padding_rows


@dataclass
class ChunkState:
    """What the forward computes per chunk slot, kept for the backward (all ``[NC, HV, ...]``)."""

    slots: ChunkSlots
    index: Tensor  # [NC, C] token index of each slot row; T (a spare row) where the row is padding
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    Gam: Tensor
    Mqk: Tensor
    Mkk: Tensor
    Tm: Tensor
    W: Tensor
    U: Tensor
    Hin: Tensor  # state entering each slot  [NC, HV, K, V]
    E: Tensor  # resolved errors             [NC, HV, C, V]
    final: Tensor  # [N, HV, K, V]


def forward_chunks(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, h0: Tensor, cu: Tensor, C: int
) -> ChunkState:
    """The chunk pipeline on prepared flat tensors ``[T, HV, ...]`` with state ``h0 [N, HV, K, V]``."""
    T = k.shape[0]
    slots = chunk_slots(cu, T, C)
    index = slot_index(slots, C, T)
    qc, kc, vc, gc, bc = (gather(x, index) for x in (q, k, v, g, beta))
    Gam = chunk_local_cumsum(gc)
    Mqk, Mkk = intra_chunk(qc, kc, bc, Gam, scale)
    Tm = solve_unit_lower(Mkk)
    W, U = wy_factors(Tm, kc, vc, bc, Gam)
    Gl = Gam[..., -1, :]
    Kend = kc * (Gl.unsqueeze(-2) - Gam).exp()
    Hin, E, final = state_scan(W, U, Kend, Gl, h0, slots)
    return ChunkState(slots, index, qc, kc, vc, gc, bc, Gam, Mqk, Mkk, Tm, W, U, Hin, E, final)


def _outputs(st: ChunkState, scale: float) -> Tensor:
    """``O = Qt S + Mqk E`` per slot."""
    Qt = scale * st.q * st.Gam.exp()
    return Qt @ st.Hin + st.Mqk @ st.E


def flatten_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Transforms and head expansion (:func:`~.prepare.prepare_flat`, on the ``[B, T, ...]`` inputs: the transforms
    round alike on every layout of the same shape), then flattening to ``[B*T, HV, ...]``; the state in the compute
    dtype, ``[N, HV, K, V]`` in either layout (with ``opts.state_v_first`` a transposed copy: the oracle transposes
    at its boundary, so that the chunk math is the same computation in either layout)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = state_dtype(v)
    qp, kp, gp, bp = (x.flatten(0, 1) for x in prepare_flat(q, k, g, beta, A_log, dt_bias, opts, dtype))
    cu = flat_cu_seqlens(cu_seqlens, B, T, v.device)
    N = cu.shape[0] - 1
    if initial_state is None:
        h0 = v.new_zeros(N, HV, K, V, dtype=dtype)
    else:
        h0 = transposed(initial_state.to(dtype)) if opts.state_v_first else initial_state.to(dtype)
    return qp, kp, v.to(dtype).flatten(0, 1), gp, bp, h0, cu


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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """Returns ``o [B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` (``(0,)`` when not asked);
    with ``opts.state_v_first`` the initial and final states are ``[N, HV, V, K]``.

    Computes in float32 (float64 for float64 inputs); the final state is float32 (float64).
    """
    o, final, _ = chunk_fwd_states(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts,
                                   output_final_state, chunk_size)  # fmt: skip
    return o, final


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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`chunk_fwd` and the state entering each chunk (:func:`kda_ops.varlen.chunk_states`)."""
    B, T = q.shape[:2]
    qp, kp, vp, gp, bp, h0, cu = flatten_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, opts)
    st = forward_chunks(qp, kp, vp, gp, bp, scale, h0, cu, chunk_size)
    o = scatter(_outputs(st, scale), st.index, B * T).unflatten(0, (B, T))
    final = st.final if output_final_state else st.final.new_empty(0)
    if output_final_state and opts.state_v_first:
        final = transposed(final)
    states = chunk_states(st.Hin, st.slots.count, B, T, cu_seqlens is not None, chunk_size, chunk_states_dtype(v),
                          opts.state_v_first)  # fmt: skip
    return o.to(v.dtype), final, states


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
    """The CPU kernel of ``torch.ops.kda.chunk_update_``: :func:`chunk_fwd` from each sequence's pool slot, its
    final state written back there in place (:mod:`kda_ops.reference.pool`); returns ``o``. With
    ``checkpoint_indices [N, C]``, the state after ``(m + 1) * checkpoint_every`` tokens of each real sequence goes
    to slot ``checkpoint_indices[n, m]`` (-1, or past the sequence's end: none), each computed on its own by
    :func:`chunk_fwd` over that prefix (reading the lengths on the host: the CPU kernel)."""
    h0, slot, valid = read_slots(state_pool, state_indices)
    o, final = chunk_fwd(q, k, v, g, beta, scale, h0, cu_seqlens, A_log, dt_bias, opts, True)
    if checkpoint_indices is not None:
        _checkpoints(q, k, v, g, beta, scale, h0, cu_seqlens, A_log, dt_bias, opts, state_pool, valid,
                     checkpoint_every, checkpoint_indices)  # fmt: skip
    write_slots(state_pool, slot, valid, final)
    return zero_padding_rows(o, valid, cu_seqlens)


def _checkpoints(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    h0: Tensor,
    cu_seqlens: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    state_pool: Tensor,
    valid: Tensor,
    every: int,
    idx: Tensor,
) -> None:
    """The prefix states of :func:`chunk_update`'s checkpoints into their slots."""
    B, T = q.shape[:2]
    if cu_seqlens is None:
        rows = [(n, 0, T) for n in range(B)]
    else:
        cu = cu_seqlens.tolist()  # sync-ok: the reference kernel (the CPU's, or fp64 checks on a GPU)
        rows = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    S = state_pool.shape[0]
    slots = idx.tolist()  # sync-ok: as above
    for n, ok in enumerate(valid.tolist()):  # sync-ok: as above
        b, bos, eos = rows[n]
        for m, slot in enumerate(slots[n]):
            end = bos + (m + 1) * every
            if not ok or end > eos or not 0 <= slot < S:
                continue
            qp, kp, vp, gp, bp = (x[b : b + 1, bos:end] for x in (q, k, v, g, beta))
            _, s = chunk_fwd(qp, kp, vp, gp, bp, scale, h0[n : n + 1], None, A_log, dt_bias, opts, True)
            state_pool[slot] = s[0].to(state_pool.dtype)


__all__ = ["ChunkState", "chunk_fwd", "chunk_fwd_states", "chunk_update", "flatten_inputs", "forward_chunks"]
