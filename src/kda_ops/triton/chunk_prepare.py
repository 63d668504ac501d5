"""Stages 1-3 fused: everything that is local to one chunk, in one program per (chunk slot, value head).

The program computes the chunk's decays in registers (stage 1), ``Mqk``, ``Mkk``, ``Qt``, ``Kend`` (stage 2), then
``Tm = (I + Mkk)^-1`` and the WY factors (stage 3), and writes only what the state scan reads: ``Mqk``, ``W``,
``U``, ``Qt``, ``Kend`` (per token, in ``precision.store``) and ``Gam_last`` (per slot). ``Gam``, ``Mkk`` and
``Tm`` never leave the chip: at T = 32k, HV = 32, K = V = 128 the fused kernel moves ~2.6 GB where the staged
pipeline moves ~6 GB. The stage functions it calls are those of the standalone stages, each tested against its
own oracle.

The grid is the static chunk-slot map (:func:`kda_ops.varlen.chunk_slots`): ``cdiv(T, BT) + N`` slots, a program
whose slot holds no token returns at once.
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
    autotune_configs,
    col_mask,
    compute_dtype,
    contiguous,
    load_beta3,
    pow2,
    rnorm3,
    slot_rows,
    store3,
)
from kda_ops.triton.chunk_cumsum import gate_flags
from kda_ops.triton.chunk_intra import intra_masks, intra_pass
from kda_ops.triton.chunk_solve import solve_unit_lower, wy_pass
from kda_ops.triton.debug import poison
from kda_ops.varlen import ChunkSlots

# Key tiles of 16..64 channels; the intra products keep a [NB, BT, BK] column block and two [NB, BC, BT]
# accumulators live, so larger BK wants 8 warps.
# TODO(bench): prune to the winners of `python benchmarks/bench_chunk.py` on the H200.
_CONFIGS = autotune_configs(
    [
        triton.Config({"BK": bk}, num_warps=w, num_stages=1)
        for bk, w in ((32, 4), (16, 4), (32, 8), (64, 8))
    ]
)

_FLAGS = ["USE_L2NORM", "USE_GATE", "USE_A", "USE_BIAS", "USE_BOUND", "BETA_SIGMOID", "NEG_EIGVAL"]


@triton.autotune(configs=_CONFIGS, key=["K", "V", *_FLAGS, "PREC_INTRA", "PREC_SOLVE", "PREC_WY"])
@triton.jit
def chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, Mqk, W, U, Qt, Kend, Gl, slot_start, slot_count, scale, lower_bound, H, HV,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr,
    BT: tl.constexpr, USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, USE_A: tl.constexpr,
    USE_BIAS: tl.constexpr, USE_BOUND: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    PREC_INTRA: tl.constexpr, PREC_SOLVE: tl.constexpr, PREC_WY: tl.constexpr, DT: tl.constexpr,
    SPAN: tl.constexpr,
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
    # stages 1-2: decays, Qt, Kend, Gam_last (stored) and Mqk, Mkk (registers)
    Mqk3, Mkk3 = intra_pass(q, k, g, A_log, dt_bias, Qt, Kend, Gl, tok3, m3, i_c, i_h, i_hv, H, HV, scale,
                            lower_bound, rq3, rk3, K, BK, NB, BC, BT, USE_GATE, USE_A, USE_BIAS, USE_BOUND,
                            PREC_INTRA, DT, SPAN)  # fmt: skip
    beta3 = load_beta3(beta, tok3, m3, HV, i_hv, BETA_SIGMOID, NEG_EIGVAL, DT)
    Mqk3, Mkk3 = intra_masks(Mqk3, Mkk3, beta3, NB, BC, BT)
    cols = tl.arange(0, BT)
    store3(Mqk + i_hv * BT, tok3, m3, HV * BT, cols, col_mask(cols, BT, BT), Mqk3)
    # stage 3: Tm = (I + Mkk)^-1, W = Tm diag(beta) Kt, U = Tm diag(beta) V
    T2 = tl.reshape(solve_unit_lower(Mkk3, NB, BC, BT, PREC_SOLVE, DT), (BT, BT))
    tok = tl.load(slot_start + i_c).to(tl.int64) + cols
    wy_pass(T2, k, v, g, beta, A_log, dt_bias, W, U, tok3, m3, tok, cols < count, i_h, i_hv, H, HV, lower_bound,
            rk3, K, V, BK, BV, NB, BC, BT, USE_GATE, USE_A, USE_BIAS, USE_BOUND, BETA_SIGMOID, NEG_EIGVAL, PREC_WY,
            DT)  # fmt: skip


def chunk_prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    slots: ChunkSlots,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    precision: Precision,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(Mqk, W, U, Qt, Kend, Gam_last)`` of every chunk slot, from the flat token stream.

    Inputs: ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g [T, HV, K]``, ``beta [T, HV]`` as given to the public
    function. Outputs: ``Mqk [T, HV, BT]``, ``W, Qt, Kend [T, HV, K]``, ``U [T, HV, V]`` in ``precision.store``;
    ``Gam_last [NC, HV, K]`` in the compute dtype (empty slots not written).
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    NC = slots.start.shape[0]
    store = precision.store
    Mqk = q.new_empty(T, HV, BT, dtype=store)
    W = q.new_empty(T, HV, K, dtype=store)
    Qt = torch.empty_like(W)
    Kend = torch.empty_like(W)
    U = v.new_empty(T, HV, V, dtype=store)
    Gl = q.new_empty(NC, HV, K, dtype=torch.float64 if v.dtype == torch.float64 else torch.float32)
    poison(Mqk, W, U, Qt, Kend, Gl)
    chunk_prepare_kernel[(NC, HV)](
        contiguous(q), contiguous(k), contiguous(v), contiguous(g), contiguous(beta), A_log, dt_bias,
        Mqk, W, U, Qt, Kend, Gl, slots.start, slots.count, float(scale),
        0.0 if opts.lower_bound is None else float(opts.lower_bound), H, HV,
        K=K, V=V, BV=min(pow2(V), 64), NB=NB, BC=BC, BT=BT, USE_L2NORM=opts.use_qk_l2norm,
        BETA_SIGMOID=opts.use_beta_sigmoid, NEG_EIGVAL=opts.allow_neg_eigval, PREC_INTRA=precision.intra,
        PREC_SOLVE=precision.solve, PREC_WY=precision.wy, DT=compute_dtype(v), SPAN=FACTOR_SPAN,
        **gate_flags(opts, A_log, dt_bias),
    )  # fmt: skip
    return Mqk, W, U, Qt, Kend, Gl


__all__ = ["chunk_prepare"]
