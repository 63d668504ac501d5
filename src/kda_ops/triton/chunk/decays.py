"""Stage 1: the chunk-local cumulative log decay ``Gam_i = sum_{j <= i} g_j``, with the in-kernel gate fused.

The forward's later stages never read ``Gam`` from memory: each recomputes its chunk's decays in registers from
``g`` (the backward's dv stage stores it for its dq/dk stage, :func:`gam_tile`). Every exponent they need is formed
as a sum of log decays of one sign, never as a difference of two prefix sums: a difference ``Gam_i - Gam_j`` loses
``ulp(|Gam|)`` absolutely, which after a hard reset (``g ~ -1000``) is ~6e-5, a relative error of that size in every
decay that follows. :func:`chunk_decays` gives, for a ``[BT, BK]`` tile::

    Gam_i             inclusive prefix sum                             (Qt = s q exp(Gam), Kt = k exp(Gam))
    Gam_last - Gam_j  exclusive suffix sum                             (Kend = k exp(Gam_last - Gam))
    Gam_i - Gam_31    from the suffix sums (see chunk_decays)          (the anchored products)

and :func:`block_decays` the same per 16-row block for the block path::

    w_i  = sum of g over block I up to row i            (inclusive prefix in the block, <= 0)
    s_j  = sum of g over block J after row j            (exclusive suffix in the block, <= 0)
    bs_I = sum of g over block I;  b_I = sum over the blocks before I;  a_J = sum over the blocks after J
    Gam_i - Gam_j = w_i + s_j + sum_{J<L<I} bs_L  (J < I),   w_i - w_j  (J = I, formed pairwise when needed)

The anchored path reads the same three from one scan (:func:`anchored_decays`): with ``P_i = sum_{0 < j <= i} g_j``
(row 0 left out), ``Gam_i = g_0 + P_i``, ``Gam_last - Gam_i = P_last - P_i`` and ``E_i = P_i - P_mid``. These are
differences, but of sums that never hold ``g_0`` and that the anchored path bounds: it keeps a chunk only when every
``|E_i| <= 80``, so every ``|P_i| <= 160`` and each difference is exact to ``ulp(160) ~ 1.5e-5`` absolutely, the
bound ``E`` already had; a hard reset at row 0 (``g_0 ~ -1000``, the start of a new segment) stays out of all of
them. A chunk that fails the span check is redone by the block path from :func:`chunk_decays`.

An exclusive suffix is an inclusive one minus ``g_j``: exact unless ``g_j`` itself is huge, and then only token
``j``'s own column rounds. The stage tests' standalone kernel (``tests/triton/chunk/stage_kernels.py``) writes
``Gam`` and ``Gam_last`` for the stage's oracle; the gate formulas of ``reference/inputs.py`` are stated here once for
every kernel that loads ``g``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import Options, state_dtype
from kda_ops.triton.chunk.tiles import BT, chunk_grid, chunk_item, col_mask, load2, slot_rows
from kda_ops.triton.lang import LOG_FLOOR, log_decay, pdl_enter
from kda_ops.triton.launch import Launcher, cdiv, compute_dtype, contiguous, jit_any_length, launch, pdl, poison, pow2
from kda_ops.varlen import SlotRows


@triton.jit
def load_log_decay(g, A_log, dt_bias, tok, m, stride, o_k, m_k, i_hv, lower_bound, K: tl.constexpr,
                   USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                   USE_LOWER_BOUND: tl.constexpr,
                   DT: tl.constexpr):
    """The log decay of the chunk's rows, ``[BT, BK]`` (0 on padding), through the gate when it is in kernel::

        g = -exp(A_log) * softplus(x + dt_bias)                 (no lower bound)
        g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))   (exp(A_log) omitted without A_log)
    """
    mask = m[:, None] & m_k[None, :]
    x = tl.load(g + tok[:, None] * stride + o_k[None, :], mask=mask, other=0.0)
    return gate(x, mask, A_log, dt_bias, o_k, m_k, i_hv, lower_bound, K, USE_GATE, HAS_A_LOG, HAS_DT_BIAS,
                USE_LOWER_BOUND, DT)


@triton.jit
def gate(x, mask, A_log, dt_bias, o_k, m_k, i_hv, lower_bound, K: tl.constexpr, USE_GATE: tl.constexpr,
         HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, DT: tl.constexpr):
    """:func:`load_log_decay` after the load: ``x [BT, BK]`` as loaded (0 outside ``mask``) to the log decay, at
    least ``LOG_DECAY_FLOOR``."""
    x = x.to(DT)
    if USE_GATE:
        if HAS_DT_BIAS:
            x = x + tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(DT)[None, :]
        if HAS_A_LOG:
            a = tl.exp(tl.load(A_log + i_hv).to(DT))
        else:
            a = 1.0
        x = tl.where(mask, log_decay(x, a, lower_bound, HAS_A_LOG, USE_LOWER_BOUND), 0.0)
    return tl.maximum(x, LOG_FLOOR)


@triton.jit
def gam_tile(g, tok, m, i_hv, HV, o_k, m_k, K: tl.constexpr, DT: tl.constexpr):
    """``Gam [BT, BK]`` of a chunk's key tile from the prepared log decay ``g [T, HV, K]`` (the gate applied): the
    prefix sum of its rows, each at least ``LOG_DECAY_FLOOR`` (padding rows load 0 and repeat ``Gam_last``): the
    backward's dv stage, which stores it for the dq/dk stage, and that stage's block pass, which forms its flagged
    chunks' again after the anchored pass wrote ``dg`` over them."""
    return tl.cumsum(tl.maximum(load2(g + i_hv * K, tok, m, HV * K, o_k, m_k, DT), LOG_FLOOR), axis=0)


@triton.jit
def chunk_decays(g2, BT: tl.constexpr):
    """Of a chunk tile ``g2 [BT, BK]``: ``Gam``, ``Gam_last - Gam``, ``Gam_last [BK]`` and ``E = Gam - Gam_mid``
    (``mid = BT / 2 - 1``; ``E >= 0`` in the first half, ``<= 0`` in the second).

    Two scans (each costs ~470 SASS instructions per warp for a [64, 64] tile on sm_90, as much as the rest of
    the key tile together): ``E = to_end[mid] - to_end``, a difference of suffix sums over rows after ``mid - 32``
    only. Where the anchored path uses ``E`` (every ``|E| <= 80``) those suffixes stay within ~160 nats whatever
    ``g_0`` is, so ``E`` is exact to ``ulp(160) ~ 1.5e-5`` absolutely.
    """
    Gam = tl.cumsum(g2, axis=0)
    to_end = tl.cumsum(g2, axis=0, reverse=True) - g2
    second = tl.sum(tl.where(tl.arange(0, BT)[:, None] >= BT // 2, g2, 0.0), axis=0)  # to_end[mid]
    return Gam, to_end, tl.sum(g2, axis=0), second[None, :] - to_end


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def anchored_decays(g2, BT: tl.constexpr):
    """:func:`chunk_decays` for the anchored path, from one scan and one three-way reduction (module docstring):
    exact to ``ulp(160)`` where every ``|E| <= 80``, which that path checks before it keeps a chunk.

    A scan along the rows of a ``[BT, BK]`` tile crosses warps, and the three sums cost what one scan does: the
    anchored prepare kernel at B1 T32768 H32 bf16 on an H200 takes 2.38 ms with this, 2.68 with :func:`chunk_decays`.
    """
    g0, p_last, p_mid = anchor_sums(g2, BT)
    return anchored_decays_from(g2, g0, p_last, p_mid, BT)


@triton.jit
def anchor_sums(g2, BT: tl.constexpr):
    """Of a chunk tile ``g2 [BT, BK]``: ``g_0``, ``P_last`` and ``P_mid`` (``P_i = sum_{0 < j <= i} g_j``), ``[BK]``
    each, by one reduction along the rows (across warps)."""
    rows = tl.arange(0, BT)[:, None]
    rest = tl.where(rows > 0, g2, 0.0)
    return tl.reduce((tl.where(rows == 0, g2, 0.0), rest, tl.where(rows < BT // 2, rest, 0.0)), 0, _add3)


@triton.jit
def anchored_decays_from(g2, g0, p_last, p_mid, BT: tl.constexpr):
    """:func:`anchored_decays` given the tile's :func:`anchor_sums` (``[BK]`` each)."""
    rows = tl.arange(0, BT)[:, None]
    P = tl.cumsum(tl.where(rows > 0, g2, 0.0), axis=0)
    return g0[None, :] + P, p_last[None, :] - P, g0 + p_last, P - p_mid[None, :]


@triton.jit
def block_decays(g3, NB: tl.constexpr):
    """Block-local sums of ``g3 [NB, BC, BK]`` (module docstring): ``w, s [NB, BC, BK]``, ``bs [NB, BK]``."""
    w = tl.cumsum(g3, axis=1)
    s = tl.cumsum(g3, axis=1, reverse=True) - g3
    return w, s, tl.sum(g3, axis=1)


@jit_any_length
def anchor_sums_kernel(
    g, A_log, dt_bias, Sums, slot_start, slot_count, lower_bound, HV,
    K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    DT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Key tile ``program_id(1)`` of every chunk slot and value head: the tile's :func:`anchor_sums` into
    ``Sums [NC, HV, 3, K]`` (``g_0``, ``P_last``, ``P_mid``), after the gate."""
    pdl_enter(PDL)
    i_c, i_hv = chunk_item(HV)
    i_k = tl.program_id(1)
    count, tok, m = slot_rows(slot_start, slot_count, i_c, BT)
    if count == 0:
        return
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = col_mask(o_k, K, BK)
    g2 = load_log_decay(g + i_hv * K, A_log, dt_bias, tok, m, HV * K, o_k, m_k, i_hv, lower_bound, K,
                        USE_GATE, HAS_A_LOG, HAS_DT_BIAS, USE_LOWER_BOUND, DT)  # fmt: skip
    g0, p_last, p_mid = anchor_sums(g2, BT)
    p = sums_ptr(Sums, i_c, i_hv, HV, K, o_k)
    tl.store(p, g0.to(Sums.dtype.element_ty), mask=m_k)
    tl.store(p + K, p_last.to(Sums.dtype.element_ty), mask=m_k)
    tl.store(p + 2 * K, p_mid.to(Sums.dtype.element_ty), mask=m_k)


def gate_flags(opts: Options, A_log: Tensor | None, dt_bias: Tensor | None) -> dict[str, bool]:
    """The gate's compile-time flags of every kernel that loads ``g``."""
    return {
        "USE_GATE": opts.use_gate,
        "HAS_A_LOG": opts.use_gate and A_log is not None,
        "HAS_DT_BIAS": opts.use_gate and dt_bias is not None,
        "USE_LOWER_BOUND": opts.use_gate and opts.lower_bound is not None,
    }


def gate_bound(opts: Options) -> float:
    """The gate's lower bound as the kernels' runtime argument (0.0 without one: ``USE_LOWER_BOUND`` is then off)."""
    return 0.0 if opts.lower_bound is None else float(opts.lower_bound)


@triton.jit
def sums_ptr(Sums, i_c, i_hv, HV, K: tl.constexpr, o_k):
    """Where key channels ``o_k`` of slot ``i_c``, value head ``i_hv`` keep ``g_0`` in ``Sums [NC, HV, 3, K]``
    (``P_last`` at ``+ K``, ``P_mid`` at ``+ 2 * K``): the layout :func:`chunk_anchor_sums` writes and the anchored
    prepare kernel reads."""
    return Sums + (i_c.to(tl.int64) * HV + i_hv) * (3 * K) + o_k


def chunk_anchor_sums(
    g: Tensor, slots: SlotRows, A_log: Tensor | None, dt_bias: Tensor | None, opts: Options
) -> Tensor:
    """``Sums [NC, HV, 3, K]``: per chunk slot, value head and key channel, ``g_0``, ``P_last = sum_{0 < j} g_j``
    and ``P_mid = sum_{0 < j < BT / 2} g_j`` of the chunk's log decay after the gate (compute dtype; empty slots not
    written), the three sums :func:`anchored_decays` forms by a reduction across warps.

    The forward's prepare kernel (:func:`~kda_ops.triton.chunk.prepare.chunk_prepare`) reads them instead: done
    there, that reduction takes a third of the kernel's time (Nsight Compute samples, H200), and this kernel, a
    program per ``[BT, 64]`` tile, only reads ``g`` once.
    """
    T, HV, K = g.shape
    NC = slots.start.shape[0]
    Sums = g.new_empty(NC, HV, 3, K, dtype=state_dtype(g))
    poison(Sums)
    BK = min(pow2(K), 64)
    _launch_sums(
        (*chunk_grid(NC, HV), cdiv(K, BK)),
        (contiguous(g), A_log, dt_bias, Sums, slots.start, slots.count, gate_bound(opts), HV),
        dict(K=K, BK=BK, BT=BT, DT=compute_dtype(g), **gate_flags(opts, A_log, dt_bias),
             **launch("sums"), **pdl(g.device)),
    )  # fmt: skip
    return Sums


_launch_sums = Launcher(anchor_sums_kernel)

__all__ = [
    "anchor_sums",
    "anchored_decays",
    "anchored_decays_from",
    "block_decays",
    "chunk_anchor_sums",
    "chunk_decays",
    "gate_bound",
    "gam_tile",
    "gate_flags",
    "load_log_decay",
    "sums_ptr",
]
