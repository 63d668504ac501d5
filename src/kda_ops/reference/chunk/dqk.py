"""Backward stage 3, the gradients through the pairwise products and the decays (``docs/math.md``, "The chunkwise
form": ``Mqk``, ``Mkk``, ``Qt = s q exp(Gam)``, ``Kt = k exp(Gam)``, ``Kend = k exp(Gam_last - Gam)``): ``dq``,
``dk``, the rest of ``dbeta`` (through ``Mkk = beta_i P_ij``), and ``dg`` as the reverse cumulative sum within the
chunk of ``dGam`` (``Gam_last`` adds its gradient to the last row). The oracle of :mod:`kda_ops.triton.chunk.dqk`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.reference.chunk.common import expand_heads, gather, pairwise_bwd, pairwise_product, scatter, slot_index
from kda_ops.varlen import ChunkSlots


def dqk(
    q: Tensor, k: Tensor, Gam: Tensor, Gl: Tensor, beta: Tensor, dMqk: Tensor, dMkk: Tensor, dKt: Tensor,
    Hin: Tensor, E: Tensor, dSp: Tensor, dO: Tensor, dbeta: Tensor, scale: float, slots: ChunkSlots, C: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dg [T, HV, K] per value head, dbeta [T, HV] total)`` of
    :func:`kda_ops.triton.chunk.dqk.chunk_bwd_dqk`. ``q, k [T, H, K]`` as the launcher takes them, expanded to the
    value heads here."""
    T, HV = Gam.shape[:2]
    index = slot_index(slots, C, T)
    qc, kc, Gc, bc, dAc, dMc, dKtc, Ec, dOc, dbc = (
        gather(x, index) for x in (expand_heads(q, HV), expand_heads(k, HV), Gam, beta, dMqk, dMkk, dKt, E, dO, dbeta)
    )
    # padding rows hold Gam = 0 after the gather; they carry no token, but the pairwise decays need them <= Gam_last
    valid = (torch.arange(C, device=Gam.device) < slots.count[:, None])[:, None, :, None]
    Gc = torch.where(valid, Gc, Gl.unsqueeze(-2))
    b = bc.unsqueeze(-1)
    dQt = dOc @ Hin.transpose(-1, -2)
    dKend = Ec @ dSp.transpose(-1, -2)
    P = pairwise_product(kc, kc, Gc, strict=True)
    dbc = dbc + (dMc * P).sum(-1)
    dq1, dk1, dGam = pairwise_bwd(qc, kc, Gc, scale * dAc, strict=False)
    dka, dkb, dGam2 = pairwise_bwd(kc, kc, Gc, b * dMc, strict=True)
    eG = Gc.exp()
    eE = (Gl.unsqueeze(-2) - Gc).exp()
    dq = dq1 + scale * eG * dQt
    dk = dk1 + dka + dkb + eG * dKtc + eE * dKend
    dGam = dGam + dGam2 + scale * qc * eG * dQt + kc * eG * dKtc - kc * eE * dKend
    dGl = (kc * eE * dKend).sum(-2) + (dSp * (Gl.exp().unsqueeze(-1) * Hin)).sum(-1)
    dGam[..., -1, :] += dGl
    dg = dGam.flip(-2).cumsum(-2).flip(-2)
    return scatter(dq, index, T), scatter(dk, index, T), scatter(dg, index, T), scatter(dbc, index, T)


__all__ = ["dqk"]
