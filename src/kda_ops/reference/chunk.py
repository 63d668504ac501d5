"""The chunkwise form of KDA (seed article, section 6) and its analytic backward, in plain PyTorch.

The CPU kernel of ``torch.ops.kda.chunk`` and the backward of both ops on the CPU. Notation of
``backward.md`` ("The chunk, in rows"), per value head, C tokens a chunk, incoming state ``S [K, V]``::

    Gam_i  = sum_{j<=i} g_j                        chunk-local cumulative log decay
    Mkk    = beta_i sum_d k_id k_jd exp(Gam_id - Gam_jd), j < i;   Mqk likewise with s q_i, j <= i
    Tm     = (I + Mkk)^-1                          unit lower triangular
    W      = Tm diag(beta) Kt,  U = Tm diag(beta) V    (Kt = k exp(Gam))
    E      = U - W S                               resolved errors
    O      = Qt S + Mqk E                          (Qt = s q exp(Gam))
    S'     = diag(exp(Gam_last)) S + Kend^T E      (Kend = k exp(Gam_last - Gam))

Tokens are gathered into a static number of chunk slots (:mod:`kda_ops.varlen`), so no value is read on the host.
Pairwise decays are formed from differences ``Gam_i - Gam_j <= 0`` only, never from ``exp(-Gam)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kda_ops.common import Options, state_dtype
from kda_ops.reference.gates import prepare, prepare_bwd
from kda_ops.varlen import ChunkSlots, chunk_slots, flat_cu_seqlens

DEFAULT_CHUNK_SIZE = 64


def chunk_local_cumsum(g: Tensor) -> Tensor:
    """``Gam [..., C, K]``: cumulative log decay within each chunk (dim -2)."""
    return torch.cumsum(g, dim=-2)


def pairwise_decay(Gam: Tensor, strict: bool) -> Tensor:
    """``exp(Gam_i - Gam_j)`` as ``[..., C, C, K]`` where ``j < i`` (``j <= i`` unless strict), else 0."""
    C = Gam.shape[-2]
    mask = torch.ones(C, C, dtype=torch.bool, device=Gam.device).tril(-1 if strict else 0)
    diff = Gam.unsqueeze(-2) - Gam.unsqueeze(-3)
    return torch.where(mask[..., None], diff, diff.new_full((), float("-inf"))).exp()


def intra_chunk(q: Tensor, k: Tensor, beta: Tensor, Gam: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``Mqk`` (causal, with diagonal, scaled) and ``Mkk`` (strictly causal, times beta_i): ``[..., C, C]``."""
    Mqk = scale * torch.einsum("...id,...jd,...ijd->...ij", q, k, pairwise_decay(Gam, strict=False))
    Mkk = beta.unsqueeze(-1) * torch.einsum("...id,...jd,...ijd->...ij", k, k, pairwise_decay(Gam, strict=True))
    return Mqk, Mkk


def solve_unit_lower(Mkk: Tensor) -> Tensor:
    """``(I + Mkk)^-1`` for strictly lower triangular ``Mkk [..., C, C]``."""
    C = Mkk.shape[-1]
    eye = torch.eye(C, dtype=Mkk.dtype, device=Mkk.device)
    inv: Tensor = torch.linalg.solve_triangular(eye + Mkk, eye.expand_as(Mkk), upper=False, unitriangular=True)
    return inv


def wy_factors(Tm: Tensor, k: Tensor, v: Tensor, beta: Tensor, Gam: Tensor) -> tuple[Tensor, Tensor]:
    """``W = Tm diag(beta) (k exp(Gam))`` and ``U = Tm diag(beta) v``."""
    b = beta.unsqueeze(-1)
    return Tm @ (b * k * Gam.exp()), Tm @ (b * v)


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


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """Flat tokens ``[T, HV, ...]`` to slots ``[NC, HV, C, ...]``; the spare index T gives zeros."""
    xp = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return xp[index].movedim(2, 1)


def _scatter(x: Tensor, index: Tensor, T: int) -> Tensor:
    """Slots ``[NC, HV, C, ...]`` back to flat tokens ``[T, HV, ...]`` (each token lives in exactly one slot)."""
    flat = x.movedim(1, 2).flatten(0, 1)
    out = flat.new_zeros(T + 1, *flat.shape[1:]).index_add_(0, index.flatten(), flat)
    return out[:T]


def slot_index(slots: ChunkSlots, C: int, T: int) -> Tensor:
    """``[NC, C]``: the token of each slot row, or the spare index ``T`` where the row is padding."""
    rows = torch.arange(C, device=slots.start.device)
    return torch.where(rows < slots.count[:, None], slots.start[:, None] + rows, T)


def state_scan(
    W: Tensor, U: Tensor, Kend: Tensor, Gl: Tensor, h0: Tensor, slots: ChunkSlots
) -> tuple[Tensor, Tensor, Tensor]:
    """The one sequential part: the scan over chunk slots, resetting at each sequence's first chunk.

    ``W, Kend [NC, HV, C, K]``, ``U [NC, HV, C, V]``, ``Gl [NC, HV, K]``, ``h0 [N, HV, K, V]``. Returns the state
    entering each slot ``Hin [NC, HV, K, V]``, the resolved errors ``E [NC, HV, C, V]`` and the final states.
    """
    N, HV, K, V = h0.shape
    S = h0.new_zeros(HV, K, V)
    Hin, Es, Souts = [], [], []
    for c in range(W.shape[0]):
        S = torch.where(slots.first[c], h0[slots.seq[c]], S)
        Hin.append(S)
        E = U[c] - W[c] @ S
        S = Gl[c].exp().unsqueeze(-1) * S + Kend[c].transpose(-1, -2) @ E
        Es.append(E)
        Souts.append(S)
    final = torch.cat([h0, h0.new_zeros(1, HV, K, V)])
    final = final.index_copy(0, torch.where(slots.last, slots.seq, N), torch.stack(Souts))[:N]
    return torch.stack(Hin), torch.stack(Es), final


def _forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, h0: Tensor, cu: Tensor, C: int
) -> ChunkState:
    """The chunk pipeline on prepared flat tensors ``[T, HV, ...]`` with state ``h0 [N, HV, K, V]``."""
    T = k.shape[0]
    slots = chunk_slots(cu, T, C)
    index = slot_index(slots, C, T)
    qc, kc, vc, gc, bc = (_gather(x, index) for x in (q, k, v, g, beta))
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


def _prepare_flat(
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
    """Transforms, head expansion and flattening to ``[B*T, HV, ...]``; the state in the compute dtype."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = state_dtype(v)
    qp, kp, gp, bp = prepare(q, k, g, beta, A_log, dt_bias, opts, dtype)
    qp = qp.repeat_interleave(HV // H, dim=2).flatten(0, 1)
    kp = kp.repeat_interleave(HV // H, dim=2).flatten(0, 1)
    cu = flat_cu_seqlens(cu_seqlens, B, T, v.device)
    N = cu.shape[0] - 1
    h0 = v.new_zeros(N, HV, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    return qp, kp, v.to(dtype).flatten(0, 1), gp.flatten(0, 1), bp.flatten(0, 1), h0, cu


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
    """Returns ``o [B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` (``(0,)`` when not asked).

    Computes in float32 (float64 for float64 inputs); the final state is float32 (float64).
    """
    B, T = q.shape[:2]
    qp, kp, vp, gp, bp, h0, cu = _prepare_flat(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, opts)
    st = _forward(qp, kp, vp, gp, bp, scale, h0, cu, chunk_size)
    o = _scatter(_outputs(st, scale), st.index, B * T).unflatten(0, (B, T))
    final = st.final if output_final_state else st.final.new_empty(0)
    return o.to(v.dtype), final


def _pairwise_bwd(
    a: Tensor, b: Tensor, Gam: Tensor, dX: Tensor, strict: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``X[i,j] = sum_d a_id b_jd exp(Gam_id - Gam_jd)`` (causal) to ``a``, ``b`` and ``Gam``."""
    dec = pairwise_decay(Gam, strict)
    da = torch.einsum("...ij,...jd,...ijd->...id", dX, b, dec)
    db = torch.einsum("...ij,...id,...ijd->...jd", dX, a, dec)
    # d/dGam_i of a_i b_j exp(Gam_i - Gam_j) is the term itself, and minus it for Gam_j
    dGam = a * da - b * db
    return da, db, dGam


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

    ``dht`` is the gradient of the final state (None: zero). Recomputes the forward, then runs the reverse
    scan over chunk slots (the only sequential part) and the per-chunk formulas of ``backward.md``.
    """
    B, T, H, K = q.shape
    HV = v.shape[2]
    qp, kp, vp, gp, bp, h0, cu = _prepare_flat(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, opts)
    N = h0.shape[0]
    st = _forward(qp, kp, vp, gp, bp, scale, h0, cu, chunk_size)
    dtype = h0.dtype
    dO = _gather(do.to(dtype).flatten(0, 1), st.index)
    dht_p = torch.zeros_like(h0) if dht is None or dht.numel() == 0 else dht.to(dtype)
    dht_p = torch.cat([dht_p, dht_p.new_zeros(1, *dht_p.shape[1:])])
    Gl = st.Gam[..., -1, :]
    Kend = st.k * (Gl.unsqueeze(-2) - st.Gam).exp()
    Qt = scale * st.q * st.Gam.exp()
    # reverse scan: dS' of each slot, and dE
    dS = torch.zeros_like(h0[0])
    dSps, dEs, dSins = [], [], []
    for c in reversed(range(st.index.shape[0])):
        dSp = torch.where(st.slots.last[c], dht_p[st.slots.seq[c]], dS)
        dE = Kend[c] @ dSp + st.Mqk[c].transpose(-1, -2) @ dO[c]
        dS = Gl[c].exp().unsqueeze(-1) * dSp + Qt[c].transpose(-1, -2) @ dO[c] - st.W[c].transpose(-1, -2) @ dE
        dSps.append(dSp)
        dEs.append(dE)
        dSins.append(dS)
    dSp_all, dE_all, dSin_all = (torch.stack(x[::-1]) for x in (dSps, dEs, dSins))
    # empty sequences pass the final-state gradient straight through; the others take their first slot's
    dh0 = dht_p.index_copy(0, torch.where(st.slots.first, st.slots.seq, N), dSin_all)[:N]
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
    P = torch.einsum("...id,...jd,...ijd->...ij", st.k, st.k, pairwise_decay(st.Gam, strict=True))
    dbeta = dbeta + (dMkk * P).sum(-1)
    dq1, dk1, dGam = _pairwise_bwd(st.q, st.k, st.Gam, scale * dMqk, strict=False)
    dka, dkb, dGam2 = _pairwise_bwd(st.k, st.k, st.Gam, b * dMkk, strict=True)
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
    dq_t = _scatter(dq, st.index, BT).view(B, T, H, G, K).sum(3)
    dk_t = _scatter(dk, st.index, BT).view(B, T, H, G, K).sum(3)
    dv_t = _scatter(dv, st.index, BT).unflatten(0, (B, T))
    dg_t = _scatter(dgc, st.index, BT).unflatten(0, (B, T))
    db_t = _scatter(dbeta, st.index, BT).unflatten(0, (B, T))
    dq_t, dk_t, dg_t, db_t, dA, ddt = prepare_bwd(q, k, g, beta, A_log, dt_bias, opts, dq_t, dk_t, dg_t, db_t)
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
