"""The chunkwise KDA forward in Triton (seed article, section 6): the driver of the stage kernels.

Per value head, chunks of ``BT = 64`` tokens, incoming state ``S [K, V]`` (``backward.md``, "The chunk, in rows")::

    Gam_i = sum_{j<=i} g_j                                  chunk-local cumulative log decay     (chunk_cumsum)
    Mqk, Mkk, Qt = s q exp(Gam), Kend = k exp(Gam_last - Gam)                                    (chunk_intra)
    Tm = (I + Mkk)^-1,  W = Tm diag(beta) Kt,  U = Tm diag(beta) V                               (chunk_solve)
    E  = U - W S,  S' = diag(exp(Gam_last)) S + Kend^T E    the scan over chunks                 (chunk_state)
    O  = Qt S + Mqk E                                                                            (chunk_output)

in the forward's X form (``chunk_prepare`` without ``store_tm``), with ``Tb = Tm diag(beta)`` and ``E = Tb X``::

    Mqk Tb,  Kt = k exp(Gam),  Qt,  Kb = Tb^T Kend                                               (chunk_prepare)
    X  = V - Kt S,  S' = diag(exp(Gam_last)) S + Kb^T X                                          (chunk_state)
    O  = Qt S + (Mqk Tb) X                                                                       (chunk_output)

:func:`chunk_fwd` is the kernel of ``torch.ops.kda.chunk``: stages 1-3 in one kernel per chunk
(:mod:`~kda_ops.triton.chunk_prepare`; ``Gam``, ``Mkk`` and ``Tm`` never leave the chip), then the scan keeping
the per-chunk states, then the output stage. :func:`chunk_fwd_staged` runs stages 2 and 3 as separate kernels
through memory; the switches below select the variants.

Variable length: the flat token stream (a dense batch ``[B, T]`` is ``B`` sequences of ``T``) is split into a
static ``cdiv(B*T, BT) + N`` chunk slots built on the device from ``cu_seqlens``; nothing reads a value on the
host and nothing is allocated by value, so one compiled graph and one captured CUDA graph serve every
``cu_seqlens`` with the same ``T`` and ``N``. Call :func:`kda_ops.warmup` before a capture: it compiles every
kernel variant a call can pick.
"""

from __future__ import annotations

from torch import Tensor

from kda_ops.common import Options, forward_outputs, state_dtype
from kda_ops.triton.chunk_common import Precision, contiguous, precision_for
from kda_ops.triton.chunk_intra import chunk_intra
from kda_ops.triton.chunk_map import slot_map
from kda_ops.triton.chunk_output import chunk_output
from kda_ops.triton.chunk_prepare import chunk_prepare
from kda_ops.triton.chunk_solve import chunk_solve
from kda_ops.triton.chunk_state import chunk_state
from kda_ops.triton.debug import poison

# Measured on the H200 (triton 3.6, 2026-11-29, B1 T32768 H32 bf16, same error o 3.11e-3 at T = 1000 every way):
# stages 1-3 fused 4.49 -> 4.10 ms for the forward (FUSE_PREPARE, the path the GPU suites run). The scan and the
# output stage stay two kernels: the scan with the outputs fused in was slower (1.51 ms against 0.84 + 0.49 apart)
# and faulted on the GPU; ``chunk_state`` says more.
FUSE_PREPARE = True


def _flat(x: Tensor) -> Tensor:
    """``[B, T, ...]`` to the flat token stream ``[B*T, ...]`` (contiguous)."""
    return contiguous(x).flatten(0, 1)


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
    """``o [B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` fp32 (``(0,)`` when not asked).

    The signature of ``reference.chunk_fwd`` (chunk size fixed at 64); ``precision`` defaults to
    :func:`~kda_ops.triton.chunk_common.precision_for` of v's dtype.
    """
    if not FUSE_PREPARE:
        return chunk_fwd_staged(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts,
                                output_final_state, precision)  # fmt: skip
    B, T = q.shape[:2]
    v = contiguous(v)
    o, final = forward_outputs(q, v, cu_seqlens, output_final_state)
    h0 = None if initial_state is None else contiguous(initial_state.to(state_dtype(v)))
    if B * T == 0:
        return o, final_without_tokens(final, h0, output_final_state)
    p = precision or precision_for(v.dtype)
    slots = slot_map(cu_seqlens, B, T, v.device)
    cu = slots.cu
    poison(o, final)
    # stages 1-3, fused per chunk, in the X form: Gam; Mqk, Mkk, Qt, Kend; Tm = (I + Mkk)^-1; with
    # Tb = Tm diag(beta): Mqk Tb, Kt = k exp(Gam), Kb = Tb^T Kend (neither W = Tb Kt nor U = Tb V)
    vf = _flat(v)
    MqkTb, Kt, _, Qt, Kb, Gl, _, Nrm = chunk_prepare(
        _flat(q), _flat(k), vf, _flat(g), _flat(beta), scale, slots, _opt(A_log), _opt(dt_bias), opts, p
    )
    # stage 4: X = V - Kt S (E = U - W S = Tb X);  S' = exp(Gam_last) S + Kb^T X, keeping the state entering each chunk
    Hin, X = chunk_state(Kt, vf, Kb, Gl, h0, cu, p, final=final if output_final_state else None,
                         offsets=slots.offset, norms=Nrm, x_form=True)  # fmt: skip
    # stage 5: O = Qt S + Mqk E = Qt S + (Mqk Tb) X, parallel over chunks
    chunk_output(Qt, MqkTb, Hin, X, slots, p, o.dtype, out=o.view(B * T, *o.shape[2:]), norms=Nrm)
    return o, final


def chunk_fwd_staged(
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
    """:func:`chunk_fwd` one stage at a time, every intermediate through memory (same contract)."""
    B, T = q.shape[:2]
    v = contiguous(v)
    o, final = forward_outputs(q, v, cu_seqlens, output_final_state)
    h0 = None if initial_state is None else contiguous(initial_state.to(state_dtype(v)))
    if B * T == 0:
        return o, final_without_tokens(final, h0, output_final_state)
    p = precision or precision_for(v.dtype)
    slots = slot_map(cu_seqlens, B, T, v.device)
    cu = slots.cu
    qf, kf, vf, gf, bf = (_flat(x) for x in (q, k, v, g, beta))
    A_log, dt_bias = _opt(A_log), _opt(dt_bias)
    Mqk, Mkk, Qt, Kend, Kt, Gl = chunk_intra(qf, kf, gf, bf, scale, slots, A_log, dt_bias, opts, p)
    _, W, U = chunk_solve(Mkk, Kt, vf, bf, slots, opts, p, store_tm=False)
    poison(final)
    Hin, E = chunk_state(W, U, Kend, Gl, h0, cu, p, final=final if output_final_state else None,
                         offsets=slots.offset)  # fmt: skip
    chunk_output(Qt, Mqk, Hin, E, slots, p, o.dtype, out=o.view(B * T, *o.shape[2:]))
    return o, final


def final_without_tokens(final: Tensor, h0: Tensor | None, output_final_state: bool) -> Tensor:
    """The final state when there is no token at all: the initial state (or zeros)."""
    if output_final_state:
        if h0 is None:
            final.zero_()
        else:
            final.copy_(h0)
    return final


__all__ = ["chunk_fwd", "chunk_fwd_staged", "final_without_tokens"]
