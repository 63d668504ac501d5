"""Stage 1: the chunk-local cumulative log decay ``Gam_i = sum_{j <= i} g_j``, with the in-kernel gate fused.

The later stages never read ``Gam`` from memory: they recompute the decays of each chunk in registers from ``g``
with :func:`chunk_decays`, which splits ``Gam`` over the chunk's 16-row blocks into sums of non-positive terms
only. A difference of two prefix sums, ``Gam_i - Gam_j``, loses ``ulp(|Gam|)`` absolutely: after a hard reset
(``g ~ -1000``) that is ~6e-5, a relative error of the same size in every decay that follows. Block-local sums
keep the error at the size of the decay itself::

    w_i  = sum of g over block I up to row i            (inclusive prefix in the block, <= 0)
    s_j  = sum of g over block J after row j            (exclusive suffix in the block, <= 0)
    bs_I = sum of g over block I;  b_I = sum over the blocks before I;  a_J = sum over the blocks after J
    Gam_i = b_I + w_i,   Gam_last - Gam_j = s_j + a_J,   Gam_i - Gam_j = w_i + s_j + sum_{J<L<I} bs_L  (J < I)

The standalone kernel here writes ``Gam`` and ``Gam_last`` (the stage's oracle checks them); it also states the
gate formulas of ``reference/gates.py`` once for every kernel that loads ``g``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import Options
from kda_ops.triton.chunk_common import BC, NB, col_mask, compute_dtype, contiguous, pow2, slot_rows
from kda_ops.triton.debug import poison
from kda_ops.varlen import ChunkSlots


@triton.jit
def softplus(x):
    # torch's softplus (threshold 20) to rounding; exp(x) alone where log(1 + exp(x)) would round to 0
    return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))


@triton.jit
def load_log_decay(g, A_log, dt_bias, tok3, m3, stride, o_k, m_k, i_hv, lower_bound, K: tl.constexpr,
                   USE_GATE: tl.constexpr, USE_A: tl.constexpr, USE_BIAS: tl.constexpr, USE_BOUND: tl.constexpr,
                   DT: tl.constexpr):
    """The log decay of the chunk's rows ``[NB, BC, BK]`` (0 on padding), through the gate when it is in kernel::

        g = -exp(A_log) * softplus(x + dt_bias)                 (no lower bound)
        g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))   (exp(A_log) omitted without A_log)
    """
    m = m3 & m_k[None, None, :]
    x = tl.load(g + tok3 * stride + o_k[None, None, :], mask=m, other=0.0).to(DT)
    if USE_GATE:
        if USE_BIAS:
            x = x + tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(DT)[None, None, :]
        if USE_BOUND:
            if USE_A:
                x = x * tl.exp(tl.load(A_log + i_hv).to(DT))
            x = lower_bound * (1.0 / (1.0 + tl.exp(-x)))
        else:
            x = -tl.exp(tl.load(A_log + i_hv).to(DT)) * softplus(x)
        x = tl.where(m, x, 0.0)
    return x


@triton.jit
def chunk_decays(g3, NB: tl.constexpr):
    """Block-local sums of the chunk's log decay ``g3 [NB, BC, BK]`` (module docstring)::

        w [NB, BC, BK], s [NB, BC, BK], bs [NB, BK], b [NB, BK], a [NB, BK], Gam_last [BK]
    """
    w = tl.cumsum(g3, axis=1)
    # s = (inclusive suffix) - g: exact unless g_j itself is huge, and then only row j's own decays round
    s = tl.cumsum(g3, axis=1, reverse=True) - g3
    bs = tl.sum(g3, axis=1)
    blk = tl.arange(0, NB)
    before = blk[None, :, None] < blk[:, None, None]  # [I, L, 1]: L < I
    b = tl.sum(tl.where(before, bs[None, :, :], 0.0), axis=1)
    after = blk[None, :, None] > blk[:, None, None]
    a = tl.sum(tl.where(after, bs[None, :, :], 0.0), axis=1)
    return w, s, bs, b, a, tl.sum(bs, axis=0)


@triton.jit
def chunk_cumsum_kernel(
    g, A_log, dt_bias, Gam, Gl, slot_start, slot_count, lower_bound, HV,
    K: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr,
    USE_GATE: tl.constexpr, USE_A: tl.constexpr, USE_BIAS: tl.constexpr, USE_BOUND: tl.constexpr,
    DT: tl.constexpr,
):  # fmt: skip
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count, tok3, m3 = slot_rows(slot_start, slot_count, i_c, NB, BC)
    if count == 0:
        return
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = col_mask(o_k, K, BK)
    g3 = load_log_decay(g + i_hv * K, A_log, dt_bias, tok3, m3, HV * K, o_k, m_k, i_hv, lower_bound, K,
                        USE_GATE, USE_A, USE_BIAS, USE_BOUND, DT)  # fmt: skip
    w, s, bs, b, a, gl = chunk_decays(g3, NB)
    p = Gam + i_hv * K + tok3 * (HV * K) + o_k[None, None, :]
    tl.store(p, (w + b[:, None, :]).to(Gam.dtype.element_ty), mask=m3 & m_k[None, None, :])
    tl.store(Gl + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, gl.to(Gl.dtype.element_ty), mask=m_k)


def gate_flags(opts: Options, A_log: Tensor | None, dt_bias: Tensor | None) -> dict[str, bool]:
    """The gate's compile-time flags of every kernel that loads ``g``."""
    return {
        "USE_GATE": opts.use_gate,
        "USE_A": opts.use_gate and A_log is not None,
        "USE_BIAS": opts.use_gate and dt_bias is not None,
        "USE_BOUND": opts.use_gate and opts.lower_bound is not None,
    }


def chunk_local_cumsum(
    g: Tensor, slots: ChunkSlots, A_log: Tensor | None, dt_bias: Tensor | None, opts: Options
) -> tuple[Tensor, Tensor]:
    """``Gam [T, HV, K]`` (chunk-local cumulative log decay, after the gate) and ``Gam_last [NC, HV, K]``.

    ``g [T, HV, K]`` is the flat token stream; the chunks are the slots of ``slots``. Both outputs are in the
    compute dtype (fp32, fp64 for fp64 inputs); rows of empty slots in ``Gam_last`` are not written.
    """
    T, HV, K = g.shape
    NC = slots.start.shape[0]
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    Gam = g.new_empty(T, HV, K, dtype=dtype)
    Gl = g.new_empty(NC, HV, K, dtype=dtype)
    poison(Gam, Gl)
    BK = min(pow2(K), 64)
    chunk_cumsum_kernel[(NC, HV, triton.cdiv(K, BK))](
        contiguous(g), A_log, dt_bias, Gam, Gl, slots.start, slots.count,
        0.0 if opts.lower_bound is None else float(opts.lower_bound), HV,
        K=K, BK=BK, NB=NB, BC=BC, DT=compute_dtype(g), **gate_flags(opts, A_log, dt_bias),
    )  # fmt: skip
    return Gam, Gl


__all__ = ["chunk_decays", "chunk_local_cumsum", "gate_flags", "load_log_decay", "softplus"]
