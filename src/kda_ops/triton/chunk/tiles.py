"""Chunk geometry and the register-block loads and stores of the chunk kernels.

A chunk is ``BT = 64`` consecutive tokens of one sequence; its tiles are loaded as ``[BT, BK]`` register blocks.
Where the math works per 16-row block (the block path of :mod:`~kda_ops.triton.chunk.intra`, the solve of
:mod:`~kda_ops.triton.chunk.solve`) a tile is reshaped to ``x3 [NB, BC, BK]`` (``NB = 4`` blocks of ``BC = 16``
rows): row ``I * BC + r`` of the chunk at ``x3[I, r]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda_ops.common import CHUNK_SIZE
from kda_ops.triton.lang import beta_value, rnorm

BT = CHUNK_SIZE  # tokens per chunk
BC = 16  # tokens per row block: the unit of the overflow-free decays and of the solve
NB = BT // BC

# Largest span of the cumulative log decay (in nats) that a factored product may carry in one factor. A factor is
# then at most exp(80) ~ 5.5e34: no fp32/bf16/tf32 overflow for inputs up to |x| ~ 6e3, no underflow below fp32's
# normal range on the other side. The products of masked (future) entries may overflow; they are dropped by
# `tl.where`, never multiplied by a mask.
# ANCHOR_SPAN: the whole chunk factored around its middle row, when every half chunk spans <= 80 nats (gates up to
# ~2.5 nats per token): one tensor-core product per key tile. FACTOR_SPAN: within one 16-row block of the block path
# (gates up to 5 nats per token); blocks beyond it are formed pairwise, exactly.
ANCHOR_SPAN = 80.0
FACTOR_SPAN = 80.0




# ------------------------------------------------------------------------------------------- jit helpers


@triton.jit
def scale_rows(x, n, ON: tl.constexpr):
    """``diag(n) x`` for ``x [BT, *]`` and ``n [BT]`` when ``ON``, else ``x`` (``n`` then unused, e.g. 1.0)."""
    if ON:
        return x * n[:, None]
    else:
        return x


@triton.jit
def row_factors(N, tok, m, col, stride, DT: tl.constexpr, ON: tl.constexpr):
    """Per-row factors ``N[tok, col]`` of a row-major ``[T, stride]`` table (l2norm factors), ``[BT]`` in ``DT``,
    when ``ON``; else the constant 1.0 (for :func:`scale_rows`). 0 for rows outside ``m``."""
    if ON:
        return tl.load(N + tok * stride + col, mask=m, other=0.0).to(DT)
    else:
        return 1.0


@triton.jit
def head_factors(N, tok, m, i_hv, T, DT: tl.constexpr, ON: tl.constexpr):
    """:func:`row_factors` of value head ``i_hv`` from a ``[HV, T]`` table, each head's rows contiguous: the l2norm
    factors the prepare kernel stores (:func:`~kda_ops.triton.chunk.prepare.store_norms`) and the scan and the output
    stage load."""
    return row_factors(N, tok, m, i_hv.to(tl.int64) * T, 1, DT, ON)


@triton.jit
def col_mask(o_k, K: tl.constexpr, BK: tl.constexpr):
    """``o_k < K``; a constant ``True`` when ``BK`` divides ``K``, so that the compiler sees the columns unmasked and
    vectorizes the loads (a per-element mask costs a 64-bit pointer per element: 255 registers and spills in the
    scan at K = 128, measured with ptxas for sm_90)."""
    if K % BK == 0:
        return tl.full((BK,), 1, tl.int1)
    else:
        return o_k < K


@triton.jit
def load2(ptr, tok, m, stride, o_k, m_k, DT: tl.constexpr):
    """``x[tok, o_k]`` as ``[BT, BK]`` in ``DT`` (0 outside the masks)."""
    p = ptr + tok[:, None] * stride + o_k[None, :]
    return tl.load(p, mask=m[:, None] & m_k[None, :], other=0.0).to(DT)


@triton.jit
def load2n(ptr, Nx, tok, m, stride, o_k, m_k, i_h, H, DT: tl.constexpr, NORMS: tl.constexpr):
    """:func:`load2` of q or k rows (``ptr`` at the head), times their l2norm factors ``Nx[tok, i_h]`` (``[T, H]``)
    when ``NORMS``: ``x r`` in ``DT``, the product the l2norm pass would have stored."""
    return scale_rows(load2(ptr, tok, m, stride, o_k, m_k, DT), row_factors(Nx, tok, m, i_h, H, DT, NORMS), NORMS)


@triton.jit
def tile2(ptr, tok, m, stride, o_k, m_k):
    """``x[tok, o_k]`` as ``[BT, BK]`` in its stored dtype (0 outside the masks): a product operand as loaded."""
    return tl.load(ptr + tok[:, None] * stride + o_k[None, :], mask=m[:, None] & m_k[None, :], other=0.0)


@triton.jit
def store2(ptr, tok, m, stride, o_k, m_k, x):
    p = ptr + tok[:, None] * stride + o_k[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=m[:, None] & m_k[None, :])


@triton.jit
def rnorm2(ptr, tok, m, stride, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr):
    """``1 / sqrt(sum_d x[tok, d]^2 + 1e-6)`` per row, ``[BT, 1]``: the l2norm factor over the whole key dim."""
    ss = tl.zeros((BT,), dtype=DT)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        x = load2(ptr, tok, m, stride, o_k, col_mask(o_k, K, BK), DT)
        ss += tl.sum(x * x, axis=1)
    return rnorm(ss)[:, None]


@triton.jit
def load_beta2(ptr, tok, m, HV, i_hv, USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, DT: tl.constexpr):
    """beta of the chunk's rows, ``[BT]``, 0 on padding rows."""
    x = tl.load(ptr + tok * HV + i_hv, mask=m, other=0.0).to(DT)
    return tl.where(m, beta_value(x, USE_BETA_SIGMOID, NEG_EIGVAL), 0.0)


@triton.jit
def slot_rows(slot_start, slot_count, i_c, BT: tl.constexpr):
    """Tokens of chunk slot ``i_c``: ``(count, tok [BT] int64, m)`` (``m``: the row holds a token)."""
    count = tl.load(slot_count + i_c).to(tl.int32)
    rows = tl.arange(0, BT)
    return count, tl.load(slot_start + i_c).to(tl.int64) + rows, rows < count


@triton.jit
def chunk_item(HV):
    """The ``(chunk slot, value head)`` of a program of :func:`chunk_grid`. A slot's value heads run adjacent, so
    that the programs resident at once read whole ``[BT, HV, *]`` row blocks of the token-major tensors rather than
    one head's strips of as many chunks: forward + backward at B1 T32768 H32 bf16 on an H100 14.64 ms against 14.75
    with the chunks adjacent (the forward 3.05 against 3.11)."""
    pid = tl.program_id(0)
    return pid // HV, pid % HV


def chunk_grid(NC: int, HV: int) -> tuple[int]:
    """A program per (chunk slot, value head), on one grid axis (``NC * HV`` may pass the second axis' 65535)."""
    return (NC * HV,)


@triton.jit
def max2(x):
    """The largest element of a 2-D block (a scalar)."""
    return tl.max(tl.max(x, axis=1), axis=0)


@triton.jit
def state_tile(i_n, i_hv, i_v, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Value tile ``i_v`` of the state of sequence ``i_n``, value head ``i_hv`` in an ``[N, HV, K, V]`` tensor:
    ``(o_k, m_k, o_v, m_v)`` its key and value offsets and masks, ``m_s, p_s [BK, BV]`` its mask and offsets within
    one state, and ``s_off`` the state's offset."""
    o_k = tl.arange(0, BK)
    m_k = col_mask(o_k, K, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = col_mask(o_v, V, BV)
    m_s = m_k[:, None] & m_v[None, :]
    p_s = o_k[:, None] * V + o_v[None, :]
    return o_k, m_k, o_v, m_v, m_s, p_s, (i_n.to(tl.int64) * HV + i_hv) * K * V


@triton.jit
def state_offsets(o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Offsets ``[BK, BV]`` of a state tile within one state of a user-facing tensor (an initial or final state, or
    their gradients): ``[K, V]``, or ``[V, K]`` with ``STATE_V_FIRST``. The tile stays ``[BK, BV]`` in registers;
    the chunk buffers (``Hin``, ``dS'``, the split scan's) keep the ``[K, V]`` offsets of :func:`state_tile`."""
    if STATE_V_FIRST:
        return o_v[None, :] * K + o_k[:, None]
    else:
        return o_k[:, None] * V + o_v[None, :]
