"""Oracles of the chunk backward's stages, one function per Triton stage, in the layouts of its launchers.

Same conventions as :mod:`kda_ops.reference.chunk_stages`: the flat token stream ``[T, HV, ...]``, per-token rows
of chunk matrices (``[T, HV, C]``), per-slot blocks (``[NC, HV, ...]``), prepared inputs (options applied);
q and k are ``[T, H, K]`` as the launchers take them and are expanded to the value heads here. The math is that
of :func:`kda_ops.reference.chunk.chunk_bwd` (``backward.md``), split where the Triton pipeline splits it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.reference.chunk import _gather, _pairwise_bwd, _scatter, chunk_local_cumsum, pairwise_decay, slot_index
from kda_ops.varlen import ChunkSlots


def _heads(x: Tensor, HV: int) -> Tensor:
    return x.repeat_interleave(HV // x.shape[1], dim=1)


def bwd_scan(
    dO: Tensor, Mqk: Tensor, Qt: Tensor, Kend: Tensor, W: Tensor, Gl: Tensor, dht: Tensor | None, slots: ChunkSlots,
    C: int, N: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dE [T, HV, V], dS' [NC, HV, K, V], dh0 [N, HV, K, V])``: the reverse scan over each sequence's slots."""
    T, HV, K = W.shape
    V = dO.shape[2]
    index = slot_index(slots, C, T)
    dOc, Mc, Qc, Kc, Wc = (_gather(x, index) for x in (dO, Mqk, Qt, Kend, W))
    dht_p = W.new_zeros(N + 1, HV, K, V)
    if dht is not None:
        dht_p[:N] = dht
    dS = W.new_zeros(HV, K, V)
    dSps, dEs, dSins = [], [], []
    for c in reversed(range(index.shape[0])):
        dSp = torch.where(slots.last[c], dht_p[slots.seq[c]], dS)
        dE = Kc[c] @ dSp + Mc[c].transpose(-1, -2) @ dOc[c]
        dS = Gl[c].exp().unsqueeze(-1) * dSp + Qc[c].transpose(-1, -2) @ dOc[c] - Wc[c].transpose(-1, -2) @ dE
        dSps.append(dSp)
        dEs.append(dE)
        dSins.append(dS)
    dSp_all, dE_all, dSin_all = (torch.stack(x[::-1]) for x in (dSps, dEs, dSins))
    dh0 = dht_p.index_copy(0, torch.where(slots.first, slots.seq, N), dSin_all)[:N]
    return _scatter(dE_all, index, T), dSp_all, dh0


def bwd_dv(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, Tm: Tensor, Hin: Tensor, E: Tensor, dE: Tensor, dO: Tensor,
    slots: ChunkSlots, C: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dv, dbeta (the part through U and W), dMqk, dMkk, dKt, Gam)`` of :func:`kda_ops.triton.chunk_bwd_dv`."""
    T, HV = v.shape[:2]
    index = slot_index(slots, C, T)
    kc, vc, gc, bc, Tc, Ec, dEc, dOc = (_gather(x, index) for x in (_heads(k, HV), v, g, beta, Tm, E, dE, dO))
    Gam = chunk_local_cumsum(gc)
    Kt = kc * Gam.exp()
    b = bc.unsqueeze(-1)
    TmT = Tc.transpose(-1, -2)
    dMqk = (dOc @ Ec.transpose(-1, -2)).tril()
    dW = -dEc @ Hin.transpose(-1, -2)
    X, Y = TmT @ dEc, TmT @ dW
    dbeta = (X * vc).sum(-1) + (Y * Kt).sum(-1)
    dT = dEc @ (b * vc).transpose(-1, -2) + dW @ (b * Kt).transpose(-1, -2)
    dMkk = -(TmT @ dT @ TmT).tril(-1)
    return (
        _scatter(b * X, index, T),
        _scatter(dbeta, index, T),
        _scatter(dMqk, index, T),
        _scatter(dMkk, index, T),
        _scatter(b * Y, index, T),
        _scatter(Gam, index, T),
    )


def bwd_dqk(
    q: Tensor, k: Tensor, Gam: Tensor, Gl: Tensor, beta: Tensor, dMqk: Tensor, dMkk: Tensor, dKt: Tensor,
    Hin: Tensor, E: Tensor, dSp: Tensor, dO: Tensor, dbeta: Tensor, scale: float, slots: ChunkSlots, C: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dg [T, HV, K] per value head, dbeta [T, HV] total)`` of :func:`kda_ops.triton.chunk_bwd_dqk`."""
    T, HV = Gam.shape[:2]
    index = slot_index(slots, C, T)
    qc, kc, Gc, bc, dAc, dMc, dKtc, Ec, dOc, dbc = (
        _gather(x, index) for x in (_heads(q, HV), _heads(k, HV), Gam, beta, dMqk, dMkk, dKt, E, dO, dbeta)
    )
    # padding rows hold Gam = 0 after the gather; they carry no token, but the pairwise decays need them <= Gam_last
    valid = (torch.arange(C, device=Gam.device) < slots.count[:, None])[:, None, :, None]
    Gc = torch.where(valid, Gc, Gl.unsqueeze(-2))
    b = bc.unsqueeze(-1)
    dQt = dOc @ Hin.transpose(-1, -2)
    dKend = Ec @ dSp.transpose(-1, -2)
    P = torch.einsum("...id,...jd,...ijd->...ij", kc, kc, pairwise_decay(Gc, strict=True))
    dbc = dbc + (dMc * P).sum(-1)
    dq1, dk1, dGam = _pairwise_bwd(qc, kc, Gc, scale * dAc, strict=False)
    dka, dkb, dGam2 = _pairwise_bwd(kc, kc, Gc, b * dMc, strict=True)
    eG = Gc.exp()
    eE = (Gl.unsqueeze(-2) - Gc).exp()
    dq = dq1 + scale * eG * dQt
    dk = dk1 + dka + dkb + eG * dKtc + eE * dKend
    dGam = dGam + dGam2 + scale * qc * eG * dQt + kc * eG * dKtc - kc * eE * dKend
    dGl = (kc * eE * dKend).sum(-2) + (dSp * (Gl.exp().unsqueeze(-1) * Hin)).sum(-1)
    dGam[..., -1, :] += dGl
    dg = dGam.flip(-2).cumsum(-2).flip(-2)
    return _scatter(dq, index, T), _scatter(dk, index, T), _scatter(dg, index, T), _scatter(dbc, index, T)


__all__ = ["bwd_dqk", "bwd_dv", "bwd_scan"]
