"""The analytic chunkwise backward, all stages in one pass: the CPU backward of both ops (``torch.ops.kda.chunk``
and ``torch.ops.kda.recurrent`` compute the same function). Mirrors the driver :mod:`kda_ops.triton.chunk.backward`.

It recomputes the forward (:func:`~kda_ops.reference.chunk.forward.forward_chunks`), runs the reverse scan over
chunk slots (the formulas of :mod:`.scan_bwd`), then, in parallel over the slots, the gradients through the WY
factors (:mod:`.dv`) and the pairwise products (:mod:`.dqk`) of ``docs/math.md`` ("The chunkwise form"), and chains
the input transforms' gradients (:func:`kda_ops.reference.inputs.transform_inputs_bwd`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.common import Options, transposed
from kda_ops.reference.chunk.common import (
    DEFAULT_CHUNK_SIZE,
    gather,
    pairwise_bwd,
    pairwise_product,
    scatter,
    stack_slots,
)
from kda_ops.reference.chunk.forward import flatten_inputs, forward_chunks
from kda_ops.reference.inputs import transform_inputs_bwd
from kda_ops.reference.threads import loop_threads


def chunk_bwd(
    do: Tensor,
    dht: Tensor | None,
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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)`` of the forward; None where an input is absent.

    ``dht`` is the gradient of the final state (None: zero); ``dht`` and ``dh0`` are ``[N, HV, V, K]`` with
    ``opts.state_v_first`` (transposed copies here). Recomputes the forward, then runs the reverse
    scan over chunk slots (the only sequential part) and the per-chunk gradient formulas.
    """
    B, T, H, K = q.shape
    HV = v.shape[2]
    qp, kp, vp, gp, bp, h0, cu = flatten_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, opts)
    N = h0.shape[0]
    st = forward_chunks(qp, kp, vp, gp, bp, scale, h0, cu, chunk_size)
    dtype = h0.dtype
    dO = gather(do.to(dtype).flatten(0, 1), st.index)
    if dht is None or dht.numel() == 0:
        dht_p = torch.zeros_like(h0)
    else:
        dht_p = transposed(dht.to(dtype)) if opts.state_v_first else dht.to(dtype)
    dht_p = torch.cat([dht_p, dht_p.new_zeros(1, *dht_p.shape[1:])])
    Gl = st.Gam[..., -1, :]
    Kend = st.k * (Gl.unsqueeze(-2) - st.Gam).exp()
    Qt = scale * st.q * st.Gam.exp()
    # reverse scan: dS' of each slot, and dE
    dS = h0.new_zeros(h0.shape[1:])
    dSps, dEs, dSins = [], [], []
    with loop_threads(dS.numel()):
        for c in reversed(range(st.index.shape[0])):
            dSp = torch.where(st.slots.last[c], dht_p[st.slots.seq[c]], dS)
            dE = Kend[c] @ dSp + st.Mqk[c].transpose(-1, -2) @ dO[c]
            dS = Gl[c].exp().unsqueeze(-1) * dSp + Qt[c].transpose(-1, -2) @ dO[c] - st.W[c].transpose(-1, -2) @ dE
            dSps.append(dSp)
            dEs.append(dE)
            dSins.append(dS)
    dSp_all, dSin_all = (stack_slots(x[::-1], dS.shape, dS) for x in (dSps, dSins))
    dE_all = stack_slots(dEs[::-1], st.E.shape[1:], dS)
    # empty sequences pass the final-state gradient straight through; the others take their first slot's
    dh0 = dht_p.index_copy(0, torch.where(st.slots.first, st.slots.seq, N), dSin_all)[:N]
    if opts.state_v_first:
        dh0 = transposed(dh0)
    # everything below is parallel over chunk slots
    Ht = st.Hin.transpose(-1, -2)
    dQt = dO @ Ht
    dMqk = (dO @ st.E.transpose(-1, -2)).tril()
    dKend = st.E @ dSp_all.transpose(-1, -2)
    dW = -dE_all @ Ht
    TmT = st.Tm.transpose(-1, -2)
    X, Y = TmT @ dE_all, TmT @ dW
    b = st.beta.unsqueeze(-1)
    Kt = st.k * st.Gam.exp()
    dv = b * X
    dKt = b * Y
    dbeta = (X * st.v).sum(-1) + (Y * Kt).sum(-1)
    dT = dE_all @ (b * st.v).transpose(-1, -2) + dW @ (b * Kt).transpose(-1, -2)
    dMkk = -(TmT @ dT @ TmT).tril(-1)
    # Mkk = beta_i P_ij: recompute P rather than divide by beta
    P = pairwise_product(st.k, st.k, st.Gam, strict=True)
    dbeta = dbeta + (dMkk * P).sum(-1)
    dq1, dk1, dGam = pairwise_bwd(st.q, st.k, st.Gam, scale * dMqk, strict=False)
    dka, dkb, dGam2 = pairwise_bwd(st.k, st.k, st.Gam, b * dMkk, strict=True)
    dGam = dGam + dGam2
    eG = st.Gam.exp()
    eE = (Gl.unsqueeze(-2) - st.Gam).exp()
    dq = dq1 + scale * eG * dQt
    dk = dk1 + dka + dkb + eG * dKt + eE * dKend
    dGam = dGam + Qt * dQt + Kt * dKt - Kend * dKend
    dGl = (Kend * dKend).sum(-2) + (dSp_all * (Gl.exp().unsqueeze(-1) * st.Hin)).sum(-1)
    dGam[..., -1, :] += dGl
    dgc = dGam.flip(-2).cumsum(-2).flip(-2)
    # slots back to tokens, value heads back to q/k heads
    BT = B * T
    G = HV // H
    dq_t = scatter(dq, st.index, BT).view(B, T, H, G, K).sum(3)
    dk_t = scatter(dk, st.index, BT).view(B, T, H, G, K).sum(3)
    dv_t = scatter(dv, st.index, BT).unflatten(0, (B, T))
    dg_t = scatter(dgc, st.index, BT).unflatten(0, (B, T))
    db_t = scatter(dbeta, st.index, BT).unflatten(0, (B, T))
    dq_t, dk_t, dg_t, db_t, dA, ddt = transform_inputs_bwd(q, k, g, beta, A_log, dt_bias, opts, dq_t, dk_t, dg_t, db_t)
    return (
        dq_t.to(q.dtype),
        dk_t.to(k.dtype),
        dv_t.to(v.dtype),
        dg_t.to(g.dtype),
        db_t.to(beta.dtype),
        None if initial_state is None else dh0.to(initial_state.dtype),
        None if dA is None or A_log is None else dA.to(A_log.dtype),
        None if ddt is None or dt_bias is None else ddt.to(dt_bias.dtype),
    )


__all__ = ["chunk_bwd"]
