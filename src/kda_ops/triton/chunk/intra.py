"""Stage 2: the chunk's interaction matrices, and its decayed queries and keys.

Per chunk and value head (``docs/math.md``, "The chunkwise form")::

    Mqk[i, j] = s      sum_d q_id k_jd exp(Gam_id - Gam_jd)    j <= i
    Mkk[i, j] = beta_i sum_d k_id k_jd exp(Gam_id - Gam_jd)    j <  i
    Qt_i = s q_i exp(Gam_i),   Kend_i = k_i exp(Gam_last - Gam_i),   Kt_i = k_i exp(Gam_i),   Gam_last

No factor ``exp(-Gam)`` over the chunk ever appears (it overflows beyond a span of ~88 nats). Each key tile takes
one of two paths, chosen from the tile's decays on the device:

- **anchored** (the usual case: every half chunk spans at most
  :data:`~kda_ops.triton.chunk.tiles.ANCHOR_SPAN` nats, i.e. gates up to ~2.5 nats per token): with
  ``E_i = Gam_i - Gam_31``, ``Mqk = (s q e^{E}) (k e^{-E})^T``, one tensor-core product ``[BT, BK] x [BK, BT]``.
  Both factors stay within ``e^{+-80}``; a valid entry (``j <= i``) is a product of two such factors equal to a
  decay ``<= 1``; a future entry may overflow and is dropped by the mask.
- **block** (stronger decays): per 16-row block ``I`` and earlier block ``J``, the factors
  ``(q_i e^{w_i}) (k_j e^{s_j} e^{R_IJ})`` (``R_IJ``: the blocks strictly between) are both ``<= 1``; the diagonal
  block is ``(q_i e^{w_i}) (k_j e^{-w_j})`` while the block spans at most
  :data:`~kda_ops.triton.chunk.tiles.FACTOR_SPAN` nats, else (a hard reset) pairwise, ``exp`` of exact segment
  sums. Each row block is one batched product ``[BC, BK] x [BK, BT]``.

The causal masks apply after the products, always.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda_ops.triton.chunk.decays import (
    anchored_decays,
    anchored_decays_from,
    block_decays,
    chunk_decays,
    gate,
    sums_ptr,
)
from kda_ops.triton.chunk.tiles import (
    col_mask,
    rnorm2,
    row_factors,
    store2,
)
from kda_ops.triton.lang import mm


@triton.jit
def diag_pairwise(qs3, k3, g3, NB: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr):
    """The diagonal 16x16 blocks of Mqk and Mkk (no mask, no beta) from pairwise decays, ``[NB, BC, BC]`` each.

    Column ``c`` of block ``I`` decays by ``exp(sum_{c < t <= i} g_t)``: an exact segment sum, never a difference.
    """
    r = tl.arange(0, BC)
    r3 = r[None, :, None]
    Dq = tl.zeros((NB, BC, BC), dtype=DT)
    Dk = tl.zeros((NB, BC, BC), dtype=DT)
    for c in range(BC):
        kc = tl.sum(tl.where(r3 == c, k3, 0.0), axis=1)  # [NB, BK] key c of every block
        seg = tl.cumsum(tl.where(r3 > c, g3, 0.0), axis=1)  # [NB, BC, BK]
        kce = tl.where(r3 >= c, tl.exp(seg), 0.0) * kc[:, None, :]
        Dq = tl.where(r[None, None, :] == c, tl.sum(qs3 * kce, axis=2)[:, :, None], Dq)
        Dk = tl.where(r[None, None, :] == c, tl.sum(k3 * kce, axis=2)[:, :, None], Dk)
    return Dq, Dk


@triton.jit
def on_diagonal(D, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """Diagonal blocks ``[NB, BC, BC]`` placed into row blocks ``[NB, BC, BT]`` (zeros elsewhere)."""
    blk = tl.arange(0, NB)
    D4 = tl.where(blk[:, None, None, None] == blk[None, None, :, None], D[:, :, None, :], 0.0)
    return tl.reshape(D4, (NB, BC, BT))


@triton.jit
def intra_tile(qs3, k3, g3, P, Ks, w, bs, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               PREC: tl.constexpr, DT: tl.constexpr, SPAN: tl.constexpr):
    """One key tile's row blocks ``Mqk3, Mkk3 [NB, BC, BT]`` by the block path (unmasked, without beta).

    ``qs3 = s q``, ``k3``, ``g3``: the tile as ``[NB, BC, BK]``; ``P = exp(w)``, ``Ks = k exp(s)`` and ``w, bs``
    from :func:`~kda_ops.triton.chunk.decays.block_decays`.
    """
    blk = tl.arange(0, NB)
    I3 = blk[:, None, None]
    J3 = blk[None, :, None]
    I4 = blk[:, None, None, None]
    J4 = blk[None, :, None, None]
    L4 = blk[None, None, :, None]
    # R[I, J] = sum of the block sums strictly between J and I                       [NB, NB, BK]
    R = tl.sum(tl.where((J4 < L4) & (L4 < I4), bs[None, None, :, :], 0.0), axis=2)
    eR = tl.where(J3 < I3, tl.exp(R), 0.0)
    span = tl.max(tl.max(-bs, axis=1), axis=0)
    # k_j exp(Gam before the block - Gam_j) >= |k_j|: the diagonal block's columns, zero unless factored
    Kd = k3 * (tl.exp(tl.minimum(-w, SPAN)) * tl.where(span <= SPAN, 1.0, 0.0))
    # columns seen by row block I: earlier blocks decayed to the start of block I, and its own block
    Cf = eR[:, :, None, :] * Ks[None, :, :, :] + tl.where(J4 == I4, Kd[None, :, :, :], 0.0)
    CfT = tl.permute(tl.reshape(Cf, (NB, BT, BK)), (0, 2, 1))  # [NB, BK, BT]
    Mqk3 = mm(qs3 * P, CfT, PREC, DT)
    Mkk3 = mm(k3 * P, CfT, PREC, DT)
    if span > SPAN:
        Dq, Dk = diag_pairwise(qs3, k3, g3, NB, BC, DT)
        Mqk3 += on_diagonal(Dq, NB, BC, BT)
        Mkk3 += on_diagonal(Dk, NB, BC, BT)
    return Mqk3, Mkk3


@triton.jit
def intra_blocks(qs, kk, g2, Mqk, Mkk, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 PREC: tl.constexpr, DT: tl.constexpr, SPAN: tl.constexpr):
    """Add one key tile ``[BT, BK]`` to ``Mqk, Mkk [BT, BT]`` by the block path."""
    qs3 = tl.reshape(qs, (NB, BC, BK))
    k3 = tl.reshape(kk, (NB, BC, BK))
    g3 = tl.reshape(g2, (NB, BC, BK))
    w, s, bs = block_decays(g3, NB)
    Mqk3, Mkk3 = intra_tile(qs3, k3, g3, tl.exp(w), k3 * tl.exp(s), w, bs, NB, BC, BT, BK, PREC, DT, SPAN)
    return Mqk + tl.reshape(Mqk3, (BT, BT)), Mkk + tl.reshape(Mkk3, (BT, BT))


@triton.jit
def intra_anchored(qs, kk, E, Mqk, Mkk, PREC: tl.constexpr, DT: tl.constexpr, SPAN: tl.constexpr):
    """Add one key tile ``[BT, BK]`` to ``Mqk, Mkk [BT, BT]`` factored around the chunk's middle row
    (``E = Gam - Gam_mid``; valid only when ``|E| <= SPAN``)."""
    Rq = tl.exp(tl.minimum(E, SPAN))
    kcT = tl.trans(kk * tl.exp(tl.minimum(-E, SPAN)))
    Mqk += mm(qs * Rq, kcT, PREC, DT)
    Mkk += mm(kk * Rq, kcT, PREC, DT)
    return Mqk, Mkk


@triton.jit
def row_span(span, E):
    """``max(span, max_d |E|)`` per row, ``[BT]``: the anchored path's span check, carried over the key tiles and
    reduced across warps once, after the key loop (``tl.max(span, axis=0) <= ASPAN``), not once per tile."""
    return tl.maximum(span, tl.max(tl.abs(E), axis=1))


@triton.jit
def key_loads(q, k, g, tok, m, i_h, i_hv, H, HV, i_k, K: tl.constexpr, BK: tl.constexpr):
    """Key tile ``i_k`` of the chunk's ``q``, ``k`` and raw ``g`` as loaded, ``[BT, BK]`` each (the loads of
    :func:`key_tile`, apart so that a loop can issue the next tile's while it computes this one)."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = col_mask(o_k, K, BK)
    mask = m[:, None] & m_k[None, :]
    rows = tok[:, None]
    xq = tl.load(q + i_h * K + rows * (H * K) + o_k[None, :], mask=mask, other=0.0)
    xk = tl.load(k + i_h * K + rows * (H * K) + o_k[None, :], mask=mask, other=0.0)
    xg = tl.load(g + i_hv * K + rows * (HV * K) + o_k[None, :], mask=mask, other=0.0)
    return xq, xk, xg


@triton.jit
def key_tile(q, k, g, A_log, dt_bias, Qt, Kend, Gl, Kt, tok, m, i_c, i_h, i_hv, H, HV, scale, lower_bound, rq, rk,
             i_k, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
             HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, DT: tl.constexpr, ANCHORED: tl.constexpr):
    """Load key tile ``i_k`` of the chunk and store its ``Qt``, ``Kend``, ``Kt = k exp(Gam)`` (the operand of ``W``,
    :func:`~kda_ops.triton.chunk.solve.wy_stored`) and ``Gam_last``.

    Returns ``s q``, ``k`` (l2-normalised when asked), ``g`` (after the gate) and ``E = Gam - Gam_mid``, ``[BT, BK]``.
    ``ANCHORED``: the decays of the anchored path (:func:`~kda_ops.triton.chunk.decays.anchored_decays`, exact only
    where it keeps the chunk), else of the block path.
    """
    xq, xk, xg = key_loads(q, k, g, tok, m, i_h, i_hv, H, HV, i_k, K, BK)
    return key_compute(xq, xk, xg, None, A_log, dt_bias, Qt, Kend, Gl, Kt, tok, m, i_c, i_hv, HV, scale,
                       lower_bound, rq, rk, i_k, K, BK, BT, USE_GATE, HAS_A_LOG, HAS_DT_BIAS, USE_LOWER_BOUND, DT,
                       ANCHORED,
                       False)  # fmt: skip


@triton.jit
def key_compute(xq, xk, xg, Sums, A_log, dt_bias, Qt, Kend, Gl, Kt, tok, m, i_c, i_hv, HV, scale,
                lower_bound, rq, rk, i_k, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, USE_GATE: tl.constexpr,
                HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, DT: tl.constexpr,
                ANCHORED: tl.constexpr, GIVEN_SUMS: tl.constexpr):
    """:func:`key_tile` from the tiles as :func:`key_loads` loaded them. ``GIVEN_SUMS`` (anchored only): the tile's
    :func:`~kda_ops.triton.chunk.decays.anchor_sums` are read from ``Sums [NC, HV, 3, K]``
    (:func:`~kda_ops.triton.chunk.decays.chunk_anchor_sums`) rather than reduced here."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = col_mask(o_k, K, BK)
    qs = xq.to(DT) * rq * scale  # a tensor times scale: rq may be the constant 1.0 (fp64 exact in the interpreter)
    kk = xk.to(DT) * rk
    g2 = gate(xg, m[:, None] & m_k[None, :], A_log, dt_bias, o_k, m_k, i_hv, lower_bound, K, USE_GATE, HAS_A_LOG,
              HAS_DT_BIAS, USE_LOWER_BOUND, DT)  # fmt: skip
    if ANCHORED and GIVEN_SUMS:
        p = sums_ptr(Sums, i_c, i_hv, HV, K, o_k)
        g0 = tl.load(p, mask=m_k, other=0.0).to(DT)
        p_last = tl.load(p + K, mask=m_k, other=0.0).to(DT)
        p_mid = tl.load(p + 2 * K, mask=m_k, other=0.0).to(DT)
        Gam, to_end, gl, E = anchored_decays_from(g2, g0, p_last, p_mid, BT)
    elif ANCHORED:
        Gam, to_end, gl, E = anchored_decays(g2, BT)
    else:
        Gam, to_end, gl, E = chunk_decays(g2, BT)
    store2(Qt + i_hv * K, tok, m, HV * K, o_k, m_k, qs * tl.exp(Gam))
    store2(Kend + i_hv * K, tok, m, HV * K, o_k, m_k, kk * tl.exp(to_end))
    tl.store(Gl + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, gl.to(Gl.dtype.element_ty), mask=m_k)
    store2(Kt + i_hv * K, tok, m, HV * K, o_k, m_k, kk * tl.exp(Gam))
    return qs, kk, g2, E


@triton.jit
def qk_norms(q, k, tok, m, i_h, H, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
             USE_L2NORM: tl.constexpr, DT: tl.constexpr):
    """The l2norm factors of the chunk's q and k rows, ``[BT, 1]`` (1.0 without l2norm)."""
    if USE_L2NORM:
        rq = rnorm2(q + i_h * K, tok, m, H * K, K, BK, BT, DT)
        rk = rnorm2(k + i_h * K, tok, m, H * K, K, BK, BT, DT)
    else:
        rq = 1.0
        rk = 1.0
    return rq, rk


@triton.jit
def chunk_norms(q, k, Rqk, tok, m, i_h, H, T, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                USE_L2NORM: tl.constexpr, GIVEN_NORMS: tl.constexpr, DT: tl.constexpr):
    """The l2norm factors of the chunk's q and k rows, ``[BT, 1]``: read from ``Rqk`` (``GIVEN_NORMS``, see
    :func:`given_norms`) or computed (:func:`qk_norms`)."""
    if GIVEN_NORMS:
        rq, rk = given_norms(Rqk, tok, m, i_h, H, T, DT)
    else:
        rq, rk = qk_norms(q, k, tok, m, i_h, H, K, BK, BT, USE_L2NORM, DT)
    return rq, rk


@triton.jit
def given_norms(Rqk, tok, m, i_h, H, T, DT: tl.constexpr):
    """The l2norm factors of the chunk's q and k rows, ``[BT, 1]``, read from ``Rqk [2, T, H]`` (computed before the
    kernel, ``kda_ops.triton.chunk.l2norm.l2norm_factors``)."""
    rq = row_factors(Rqk, tok, m, i_h, H, DT, True)
    rk = row_factors(Rqk + T * H, tok, m, i_h, H, DT, True)
    return rq[:, None], rk[:, None]


@triton.jit
def intra_masks(Mqk, Mkk, beta, BT: tl.constexpr):
    """The causal masks (with the diagonal for Mqk, strictly below it for Mkk) and beta_i on Mkk's rows."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    return tl.where(cols <= rows, Mqk, 0.0), tl.where(cols < rows, Mkk, 0.0) * beta[:, None]


__all__ = [
    "diag_pairwise",
    "intra_anchored",
    "intra_blocks",
    "intra_masks",
    "intra_tile",
    "key_compute",
    "key_loads",
    "key_tile",
    "on_diagonal",
    "chunk_norms",
    "given_norms",
    "qk_norms",
    "row_span",
]
