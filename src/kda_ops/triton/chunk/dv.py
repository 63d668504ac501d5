"""Backward stage 3a: per chunk, the value-side gradients and the gradients of the chunk's matrices.

One program per (chunk slot, value head), given the incoming state ``S = Hin``, the resolved errors ``E`` and their
gradient ``dE`` (stage 2) and ``dO`` (``docs/math.md``, "Chunk backward")::

    dMqk = tril(dO E^T)                                            (with the diagonal)         [BT, BT]
    X    = Tm^T dE,    dv = beta X,    dbeta  = rowsum(X * v)       through U = Tm diag(beta) V
    dW   = -dE S^T,    Y = Tm^T dW,    dKt = beta Y,   dbeta += rowsum(Y * Kt)   through W = Tm diag(beta) Kt
    dMkk = -tril(X E^T, -1)                                        through Tm = (I + Mkk)^-1

and stores ``Gam`` (the chunk-local cumulative log decay, for stage 3b). ``dv`` is final; ``dbeta`` is partial
(stage 3b adds the part through ``Mkk``); ``dMqk``, ``dMkk`` (``[T, HV, BT]`` rows, like the forward's ``Mqk``) and
``dKt`` (``[T, HV, K]``) feed stage 3b. Products take ``PREC``; ``X E^T`` takes ``PREC_T``.

``dMkk`` is ``-tril(Tm^T dT Tm^T, -1)`` for the gradient ``dT`` of ``Tm``, ``dE (diag(beta) V)^T + dW (diag(beta)
Kt)^T = dE (diag(beta) (V - Kt S))^T = dE ((I + Mkk) E)^T``, so ``-Tm^T dT Tm^T = -X E^T``: one product per value
tile from the ``X`` that ``dv`` needs anyway, instead of the key tiles' share of ``dT`` and two ``[BT, BT, BT]``
products through the inverse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.triton.chunk.decays import gam_tile
from kda_ops.triton.chunk.precision import exact_bf16
from kda_ops.triton.chunk.tiles import (
    BT,
    chunk_grid,
    chunk_item,
    col_mask,
    load2,
    row_factors,
    scale_rows,
    slot_rows,
    store2,
)
from kda_ops.triton.lang import mm, tf32_nearest
from kda_ops.triton.launch import compute_dtype, contiguous, launch, poison
from kda_ops.varlen import SlotRows


@triton.jit
def value_tiles(dO, E, dE, v, tok, m, i_hv, HV, i_v, V: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """The value tile ``i_v`` of ``dO``, ``E``, ``dE``, ``v`` ``[BT, BV]`` and its columns and mask."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = col_mask(o_v, V, BV)
    do = load2(dO + i_hv * V, tok, m, HV * V, o_v, m_v, DT)
    e = load2(E + i_hv * V, tok, m, HV * V, o_v, m_v, DT)
    de = load2(dE + i_hv * V, tok, m, HV * V, o_v, m_v, DT)
    vv = load2(v + i_hv * V, tok, m, HV * V, o_v, m_v, DT)
    return do, e, de, vv, o_v, m_v


@triton.jit
def chunk_bwd_dv_kernel(
    k, Nk, v, g, beta, Tm, Hin, E, dE, dO, dv, dbeta, dMqk, dMkk, dKt, Gam, slot_start, slot_count, H, HV,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, PREC_T: tl.constexpr, PREC_OE: tl.constexpr, DT: tl.constexpr, NORMS: tl.constexpr,
    PREFETCH: tl.constexpr = 0, LATE_STORE: tl.constexpr = 0,
):  # fmt: skip
    """Schedule (:data:`~kda_ops.triton.launch.LAUNCH` flags, 0 by default): ``PREFETCH`` loads the next value
    tile's ``dO``, ``E``, ``dE``, ``v`` before the tile's ``dv`` store, so that they issue without waiting for it;
    ``LATE_STORE`` stores ``dv`` after the tile's other products. Each runs the same operations; compiled, the
    ``PREFETCH`` form's sums may be grouped otherwise, so it can round differently."""
    i_c, i_hv = chunk_item(HV)
    i_h = i_hv // (HV // H)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count == 0:
        return
    cols = tl.arange(0, BT)
    m_c = col_mask(cols, BT, BT)
    TmT = tl.trans(load2(Tm + i_hv * BT, tok, m, HV * BT, cols, m_c, DT))  # [BT, BT]
    if PREC == "tf32rn":
        # rounded once, not per product: the products through it round it again to the same values
        TmT = tf32_nearest(TmT)
    b = tl.load(beta + tok * HV + i_hv, mask=m, other=0.0).to(DT)  # [BT]
    rk = row_factors(Nk, tok, m, i_h, H, DT, NORMS)  # the l2norm factors of the chunk's k rows (or 1.0)
    dA = tl.zeros((BT, BT), dtype=DT)
    dMk = tl.zeros((BT, BT), dtype=DT)
    db = tl.zeros((BT,), dtype=DT)
    # value side: dMqk, dv, its share of dbeta, and dMkk = -tril(X E^T, -1)
    if PREFETCH:
        do, e, de, vv, o_v, m_v = value_tiles(dO, E, dE, v, tok, m, i_hv, HV, 0, V, BV, DT)
    for i_v in range(tl.cdiv(V, BV)):
        if not PREFETCH:
            do, e, de, vv, o_v, m_v = value_tiles(dO, E, dE, v, tok, m, i_hv, HV, i_v, V, BV, DT)  # [BT, BV]
        dA += mm(do, tl.trans(e), PREC_OE, DT)
        X = mm(TmT, de, PREC, DT)
        if PREFETCH:
            e_t = e
            v_t = vv
            o_t = o_v
            m_t = m_v
            # no rows after the last tile: nothing is loaded
            do, e, de, vv, o_v, m_v = value_tiles(dO, E, dE, v, tok, m & (i_v + 1 < tl.cdiv(V, BV)), i_hv, HV,
                                                  i_v + 1, V, BV, DT)  # fmt: skip
            store2(dv + i_hv * V, tok, m, HV * V, o_t, m_t, b[:, None] * X)
            db += tl.sum(X * v_t, axis=1)
            dMk -= mm(X, tl.trans(e_t), PREC_T, DT)
        elif LATE_STORE:
            db += tl.sum(X * vv, axis=1)
            dMk -= mm(X, tl.trans(e), PREC_T, DT)
            store2(dv + i_hv * V, tok, m, HV * V, o_v, m_v, b[:, None] * X)
        else:
            store2(dv + i_hv * V, tok, m, HV * V, o_v, m_v, b[:, None] * X)
            db += tl.sum(X * vv, axis=1)
            dMk -= mm(X, tl.trans(e), PREC_T, DT)
    # key side: dW = -dE S^T per key tile, dKt and its share of dbeta; Gam stored for stage 3b
    s_off = (i_c.to(tl.int64) * HV + i_hv) * K * V
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = col_mask(o_k, K, BK)
        dW = tl.zeros((BT, BK), dtype=DT)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = col_mask(o_v, V, BV)
            de = load2(dE + i_hv * V, tok, m, HV * V, o_v, m_v, DT)
            h = tl.load(Hin + s_off + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                        other=0.0).to(DT)  # [BK, BV]  # fmt: skip
            dW -= mm(de, tl.trans(h), PREC, DT)
        # the tile's k, g loaded and its Gam stored after the dW loop: the loop's loads of dE and Hin, which the
        # compiler must assume a store ahead of them may alias, then issue early (the stage at B1 T32768 H32 bf16 on
        # an H200: 2.37 -> 2.12 ms)
        kk = scale_rows(load2(k + i_h * K, tok, m, H * K, o_k, m_k, DT), rk, NORMS)  # [BT, BK]
        Gm = gam_tile(g, tok, m, i_hv, HV, o_k, m_k, K, DT)
        Y = mm(TmT, dW, PREC, DT)
        store2(dKt + i_hv * K, tok, m, HV * K, o_k, m_k, b[:, None] * Y)
        store2(Gam + i_hv * K, tok, m, HV * K, o_k, m_k, Gm)
        db += tl.sum(Y * (kk * tl.exp(Gm)), axis=1)
    r2 = tl.arange(0, BT)[:, None]
    c2 = tl.arange(0, BT)[None, :]
    store2(dMqk + i_hv * BT, tok, m, HV * BT, cols, m_c, tl.where(c2 <= r2, dA, 0.0))
    store2(dMkk + i_hv * BT, tok, m, HV * BT, cols, m_c, tl.where(c2 < r2, dMk, 0.0))
    tl.store(dbeta + tok * HV + i_hv, db.to(dbeta.dtype.element_ty), mask=m)


def chunk_bwd_dv(
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    Tm: Tensor,
    Hin: Tensor,
    E: Tensor,
    dE: Tensor,
    dO: Tensor,
    slots: SlotRows,
    prec: str,
    prec_t: str,
    dv_dtype: torch.dtype | None = None,
    store: torch.dtype | None = None,
    norms: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dv [T, HV, V], dbeta [T, HV] partial, dMqk, dMkk [T, HV, BT], dKt [T, HV, K], Gam [T, HV, K])``.

    Inputs prepared (options applied): ``k [T, H, K]``, ``v [T, HV, V]``, the log decay ``g [T, HV, K]``,
    ``beta [T, HV]``; ``Tm [T, HV, BT]``, ``Hin [NC, HV, K, V]``, ``E [T, HV, V]`` from the recomputed forward;
    ``dE [T, HV, V]`` from the reverse scan; ``dO [T, HV, V]``. Outputs in the compute dtype (``Tm``'s); ``dv`` in
    ``dv_dtype`` when given (the driver asks for v's own: one rounding of the same fp32 value, and no conversion
    pass over ``[T, HV, V]`` afterwards); ``dMqk``, ``dMkk``, ``dKt`` in ``store`` when given (the driver passes the
    factors' storage dtype, bf16 for bf16 inputs: each is written here and read once by the dq/dk stage, one
    rounding): forward + backward at B1 T32768 H32 bf16 on an H200 21.54 -> 21.00 ms, every gradient error still
    below fla-core's.

    ``norms [2, T, H]`` (optional): the l2norm factors of q's and k's rows, with ``k`` raw: the kernel forms the
    normalised ``k`` as it loads it (:func:`~kda_ops.triton.chunk.tiles.row_factors`).
    """
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    NC = slots.start.shape[0]
    dt = Tm.dtype  # the compute dtype (Hin and E may be stored in bf16)
    dv = v.new_empty(T, HV, V, dtype=dv_dtype or dt)
    dbeta = v.new_empty(T, HV, dtype=dt)
    dMqk = v.new_empty(T, HV, BT, dtype=store or dt)
    dMkk = torch.empty_like(dMqk)
    dKt = v.new_empty(T, HV, K, dtype=store or dt)
    Gam = v.new_empty(T, HV, K, dtype=dt)
    poison(dv, dbeta, dMqk, dMkk, dKt, Gam)
    chunk_bwd_dv_kernel[chunk_grid(NC, HV)](
        contiguous(k), None if norms is None else norms[1], contiguous(v), contiguous(g), contiguous(beta),
        contiguous(Tm), Hin, contiguous(E), contiguous(dE), contiguous(dO), dv, dbeta, dMqk, dMkk, dKt, Gam,
        slots.start, slots.count, H, HV, K=K, V=V, BT=BT, PREC=prec, PREC_T=prec_t, PREC_OE=exact_bf16(prec, dO, E),
        DT=compute_dtype(Tm), NORMS=norms is not None, **launch("dv", BK=K, BV=V),
    )  # fmt: skip
    return dv, dbeta, dMqk, dMkk, dKt, Gam


__all__ = ["chunk_bwd_dv"]
