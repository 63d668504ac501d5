"""Stage 2: the chunk's interaction matrices, and its decayed queries and keys.

Per chunk and value head (``backward.md``, "The chunk, in rows")::

    Mqk[i, j] = s      sum_d q_id k_jd exp(Gam_id - Gam_jd)    j <= i
    Mkk[i, j] = beta_i sum_d k_id k_jd exp(Gam_id - Gam_jd)    j <  i
    Qt_i = s q_i exp(Gam_i),   Kend_i = k_i exp(Gam_last - Gam_i),   Gam_last

No factor ``exp(-Gam)`` over the chunk ever appears (it overflows beyond a span of ~88). The chunk is cut into
16-row blocks; with the block-local sums of :func:`~kda_ops.triton.chunk_cumsum.chunk_decays`, the pair
``(i in block I, j in block J)`` is a product of two factors:

- ``J < I``: ``(q_i e^{w_i}) (k_j e^{s_j} e^{R_IJ})`` with ``R_IJ`` the blocks strictly between: both <= 1.
- ``J = I``: ``(q_i e^{w_i}) (k_j e^{-w_j})``; the second factor is at most ``e^{span of block I}``. When every
  block spans at most :data:`~kda_ops.triton.chunk_common.FACTOR_SPAN` nats (the usual case: gates of a few
  nats per token) this is one tensor-core product; otherwise (a hard reset) the diagonal blocks are formed
  pairwise, ``exp`` of exact segment sums, ``[NB, BC, BK]`` per column.

So each row block ``I`` is one batched product ``[BC, BK] x [BK, BT]`` per key tile; the future entries that the
factored diagonal block produces are masked after the product, always.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import Options
from kda_ops.triton.chunk_common import (
    BC,
    BT,
    FACTOR_SPAN,
    NB,
    Precision,
    chunk_rows,
    col_mask,
    compute_dtype,
    contiguous,
    load3,
    load_beta3,
    mm,
    pow2,
    rnorm3,
    slot_rows,
    store3,
)
from kda_ops.triton.chunk_cumsum import chunk_decays, gate_flags, load_log_decay
from kda_ops.triton.debug import poison
from kda_ops.varlen import ChunkSlots


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
def intra_tile(qs3, k3, g3, P, Ks, w, bs, Mqk3, Mkk3, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
               BK: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, SPAN: tl.constexpr):
    """Add one key tile to the row blocks ``Mqk3, Mkk3 [NB, BC, BT]`` (unmasked, without beta).

    ``qs3 = s q``, ``k3``, ``g3``: the tile ``[NB, BC, BK]``; ``P = exp(w)``, ``Ks = k exp(s)`` and ``w, bs`` from
    :func:`chunk_decays`.
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
    Mqk3 += mm(qs3 * P, CfT, PREC, DT)
    Mkk3 += mm(k3 * P, CfT, PREC, DT)
    if span > SPAN:
        Dq, Dk = diag_pairwise(qs3, k3, g3, NB, BC, DT)
        Mqk3 += on_diagonal(Dq, NB, BC, BT)
        Mkk3 += on_diagonal(Dk, NB, BC, BT)
    return Mqk3, Mkk3


@triton.jit
def intra_pass(q, k, g, A_log, dt_bias, Qt, Kend, Gl, tok3, m3, i_c, i_h, i_hv, H, HV, scale, lower_bound, rq3, rk3,
               K: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
               USE_GATE: tl.constexpr, USE_A: tl.constexpr, USE_BIAS: tl.constexpr, USE_BOUND: tl.constexpr,
               PREC: tl.constexpr, DT: tl.constexpr, SPAN: tl.constexpr):
    """Loop over key tiles: store ``Qt``, ``Kend`` and ``Gam_last``; return the unmasked ``Mqk3, Mkk3``."""
    Mqk3 = tl.zeros((NB, BC, BT), dtype=DT)
    Mkk3 = tl.zeros((NB, BC, BT), dtype=DT)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = col_mask(o_k, K, BK)
        qs3 = load3(q + i_h * K, tok3, m3, H * K, o_k, m_k, DT) * (rq3 * scale)
        k3 = load3(k + i_h * K, tok3, m3, H * K, o_k, m_k, DT) * rk3
        g3 = load_log_decay(g + i_hv * K, A_log, dt_bias, tok3, m3, HV * K, o_k, m_k, i_hv, lower_bound, K,
                            USE_GATE, USE_A, USE_BIAS, USE_BOUND, DT)  # fmt: skip
        w, s, bs, b, a, gl = chunk_decays(g3, NB)
        P = tl.exp(w)  # exp(Gam_i - Gam before the block) <= 1
        Ks = k3 * tl.exp(s)  # k_j exp(Gam at the block's end - Gam_j)
        store3(Qt + i_hv * K, tok3, m3, HV * K, o_k, m_k, qs3 * P * tl.exp(b)[:, None, :])
        store3(Kend + i_hv * K, tok3, m3, HV * K, o_k, m_k, Ks * tl.exp(a)[:, None, :])
        tl.store(Gl + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, gl.to(Gl.dtype.element_ty), mask=m_k)
        Mqk3, Mkk3 = intra_tile(qs3, k3, g3, P, Ks, w, bs, Mqk3, Mkk3, NB, BC, BT, BK, PREC, DT, SPAN)
    return Mqk3, Mkk3


@triton.jit
def intra_masks(Mqk3, Mkk3, beta3, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """The causal masks (with the diagonal for Mqk, strictly below it for Mkk) and beta_i on Mkk's rows."""
    rows = chunk_rows(NB, BC)
    cols = tl.arange(0, BT)[None, None, :]
    return tl.where(cols <= rows, Mqk3, 0.0), tl.where(cols < rows, Mkk3 * beta3, 0.0)


@triton.jit
def chunk_intra_kernel(
    q, k, g, beta, A_log, dt_bias, Mqk, Mkk, Qt, Kend, Gl, slot_start, slot_count, scale, lower_bound, H, HV,
    K: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, USE_A: tl.constexpr, USE_BIAS: tl.constexpr,
    USE_BOUND: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    PREC: tl.constexpr, DT: tl.constexpr, SPAN: tl.constexpr,
):  # fmt: skip
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    count, tok3, m3 = slot_rows(slot_start, slot_count, i_c, NB, BC)
    if count == 0:
        return
    if USE_L2NORM:
        rq3 = rnorm3(q + i_h * K, tok3, m3, H * K, K, BK, NB, BC, DT)
        rk3 = rnorm3(k + i_h * K, tok3, m3, H * K, K, BK, NB, BC, DT)
    else:
        rq3 = 1.0
        rk3 = 1.0
    Mqk3, Mkk3 = intra_pass(q, k, g, A_log, dt_bias, Qt, Kend, Gl, tok3, m3, i_c, i_h, i_hv, H, HV, scale,
                            lower_bound, rq3, rk3, K, BK, NB, BC, BT, USE_GATE, USE_A, USE_BIAS, USE_BOUND,
                            PREC, DT, SPAN)  # fmt: skip
    beta3 = load_beta3(beta, tok3, m3, HV, i_hv, BETA_SIGMOID, NEG_EIGVAL, DT)
    Mqk3, Mkk3 = intra_masks(Mqk3, Mkk3, beta3, NB, BC, BT)
    cols = tl.arange(0, BT)
    store3(Mqk + i_hv * BT, tok3, m3, HV * BT, cols, col_mask(cols, BT, BT), Mqk3)
    store3(Mkk + i_hv * BT, tok3, m3, HV * BT, cols, col_mask(cols, BT, BT), Mkk3)


def chunk_intra(
    q: Tensor,
    k: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    slots: ChunkSlots,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    precision: Precision,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(Mqk, Mkk, Qt, Kend, Gam_last)`` of every chunk slot, from the flat token stream.

    Inputs: ``q, k [T, H, K]``, ``g [T, HV, K]``, ``beta [T, HV]`` as given to the public function (the options
    are applied in kernel). Outputs: ``Mqk, Mkk [T, HV, BT]`` (row ``t`` holds its chunk row; columns past the
    chunk's tokens are 0) in the compute dtype; ``Qt, Kend [T, HV, K]`` in ``precision.store``;
    ``Gam_last [NC, HV, K]`` in the compute dtype (empty slots not written).
    """
    T, H, K = q.shape
    HV = g.shape[1]
    NC = slots.start.shape[0]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    Mqk = q.new_empty(T, HV, BT, dtype=dtype)
    Mkk = torch.empty_like(Mqk)
    Qt = q.new_empty(T, HV, K, dtype=precision.store)
    Kend = torch.empty_like(Qt)
    Gl = q.new_empty(NC, HV, K, dtype=dtype)
    poison(Mqk, Mkk, Qt, Kend, Gl)
    chunk_intra_kernel[(NC, HV)](
        contiguous(q), contiguous(k), contiguous(g), contiguous(beta), A_log, dt_bias, Mqk, Mkk, Qt, Kend, Gl,
        slots.start, slots.count, float(scale), 0.0 if opts.lower_bound is None else float(opts.lower_bound), H, HV,
        K=K, BK=min(pow2(K), 32), NB=NB, BC=BC, BT=BT, USE_L2NORM=opts.use_qk_l2norm,
        BETA_SIGMOID=opts.use_beta_sigmoid, NEG_EIGVAL=opts.allow_neg_eigval, PREC=precision.intra,
        DT=compute_dtype(q), SPAN=FACTOR_SPAN, **gate_flags(opts, A_log, dt_bias),
    )  # fmt: skip
    return Mqk, Mkk, Qt, Kend, Gl


__all__ = ["chunk_intra", "diag_pairwise", "intra_masks", "intra_pass", "intra_tile", "on_diagonal"]
