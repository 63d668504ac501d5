"""Stage 2, the products within a chunk (``docs/math.md``, "The chunkwise form")::

    Mqk_ij = s      sum_d q_id k_jd exp(Gam_id - Gam_jd)     j <= i
    Mkk_ij = beta_i sum_d k_id k_jd exp(Gam_id - Gam_jd)     j <  i
    Qt     = s q exp(Gam),   Kend = k exp(Gam_last - Gam)

The oracle of :mod:`kda_ops.triton.chunk.intra`. The keys' ``Kt = k exp(Gam)`` is formed where it is used
(:mod:`.solve`, :mod:`.dv`).
"""

from __future__ import annotations

from torch import Tensor

from kda_ops.reference.chunk.common import chunk_local_cumsum, gather, pairwise_product, scatter, slot_index
from kda_ops.varlen import ChunkSlots


def intra_chunk(q: Tensor, k: Tensor, beta: Tensor, Gam: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``Mqk`` (causal, with diagonal, scaled) and ``Mkk`` (strictly causal, times beta_i): ``[..., C, C]``."""
    Mqk = scale * pairwise_product(q, k, Gam, strict=False)
    Mkk = beta.unsqueeze(-1) * pairwise_product(k, k, Gam, strict=True)
    return Mqk, Mkk


def intra(
    q: Tensor, k: Tensor, g: Tensor, beta: Tensor, scale: float, slots: ChunkSlots, C: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(Mqk, Mkk, Qt, Kend, Gam_last)``: ``Mqk, Mkk [T, HV, C]``, ``Qt = s q exp(Gam)``,
    ``Kend = k exp(Gam_last - Gam)`` ``[T, HV, K]``, ``Gam_last [NC, HV, K]``."""
    T = q.shape[0]
    index = slot_index(slots, C, T)
    qc, kc, gc, bc = (gather(x, index) for x in (q, k, g, beta))
    Gam = chunk_local_cumsum(gc)
    Mqk, Mkk = intra_chunk(qc, kc, bc, Gam, scale)
    Gl = Gam[..., -1, :]
    Qt = scale * qc * Gam.exp()
    Kend = kc * (Gl.unsqueeze(-2) - Gam).exp()
    return scatter(Mqk, index, T), scatter(Mkk, index, T), scatter(Qt, index, T), scatter(Kend, index, T), Gl


__all__ = ["intra", "intra_chunk"]
