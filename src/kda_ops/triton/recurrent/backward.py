"""The backward of the fused recurrent KDA kernel: reverse time, states recomputed from checkpoints.

The per-token gradients (``docs/math.md``, "Recurrent backward") walk the tokens backwards and need ``S_{t-1}`` at
every step. The update is never inverted (``exp(g)`` may be ~0); instead one program per (sequence, value head,
value tile):

1. runs the forward over its sequence, storing its state tile at the start of every segment of ``C`` tokens
   (the checkpoints);
2. for each segment, last to first: reloads the checkpoint, recomputes the segment's states ``S_{t-1}`` into a
   private scratch buffer ``[C, BV, BK]``, then walks the segment backwards::

       G    += (s q_t) do_t^T                  gradient of S_t, G starts as the final-state gradient
       dq_t  = s S_t do_t
       de    = G^T k_t ;  dk_t = G e + St dp ;  dv_t = beta_t de ;  dbeta_t = de . (v_t - p)
       dp    = -beta_t de ;  dSt = G + k_t dp^T ;  dg_t = rowsum(dSt * St) ;  G = diag(exp g_t) dSt

3. stores ``G`` as the gradient of the initial state.

Memory: the checkpoints take ``cdiv(B*T, C) + N`` states and the scratch ``N * C`` states (``HV*K*V`` floats
each); ``C ~ sqrt(tokens per sequence)`` balances the two. Recomputation costs two extra forward passes.

Sums over the value dimension (dq, dk, dg, dbeta) are per value tile: the kernel writes one partial per tile
(and per value head of a q/k group) and torch adds them up, deterministically. The chain rules through l2norm,
the gate and the beta sigmoid are linear in the incoming gradient, so the kernel applies them to each partial;
``dA_log`` and ``dt_bias`` collect per-program partial sums over tokens.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import Options, state_dtype
from kda_ops.triton.lang import beta_value, l2norm_bwd, log_decay
from kda_ops.triton.launch import compute_dtype, contiguous, poison, recurrent_bwd_config
from kda_ops.triton.recurrent.forward import (
    l2norm_rows,
    load_head_params,
    load_token,
    sequence_bounds,
)

MIN_CHECKPOINT_INTERVAL = 4
MAX_CHECKPOINT_INTERVAL = 64


def checkpoint_interval(tokens: int, sequences: int) -> int:
    """``C``: a power of two near ``sqrt(tokens per sequence)`` (from shapes only), in ``[4, 64]``."""
    per_sequence = max(1, tokens // max(1, sequences))
    C = 1 << (max(1, math.isqrt(per_sequence)) - 1).bit_length()
    return min(MAX_CHECKPOINT_INTERVAL, max(MIN_CHECKPOINT_INTERVAL, C))


# ------------------------------------------------------------------------------------------- jit helpers


@triton.jit
def gate_bwd(b_x, b_g, b_a, b_dt, b_dg, lower_bound, HAS_A_LOG: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """Gradient of the gate to its raw input ``x``, and the per-channel terms of ``dA_log`` (summed by the caller)."""
    z = b_x + b_dt
    if USE_LOWER_BOUND:
        if HAS_A_LOG:
            z = b_a * z
        s = tl.sigmoid(z)
        dz = lower_bound * s * (1.0 - s) * b_dg
        dA_terms = dz * z
        if HAS_A_LOG:
            dx = b_a * dz
        else:
            dx = dz
    else:
        dx = -b_a * tl.sigmoid(z) * b_dg
        dA_terms = b_dg * b_g  # g = -exp(A) softplus(z) is linear in exp(A)
    return dx, dA_terms


@triton.jit
def beta_bwd(b_y, b_dbeta, USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """Gradient of :func:`~kda_ops.triton.lang.beta_value` to its raw input."""
    if NEG_EIGVAL:
        b_dbeta = b_dbeta * 2.0
    if USE_BETA_SIGMOID:
        s = tl.sigmoid(b_y)
        b_dbeta = b_dbeta * s * (1.0 - s)
    return b_dbeta


@triton.jit
def forward_steps(b_S, p_q, p_k, p_g, p_beta, p_v, n, o_k, m_k, m_v, b_a, b_dt, scale, lower_bound, p_save,
                  o_save, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, DT: tl.constexpr, USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
                  HAS_A_LOG: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
                  NEG_EIGVAL: tl.constexpr, SAVE: tl.constexpr):
    """Advance the (transposed, ``[BV, BK]``) state tile over ``n`` tokens from the given token pointers; with
    SAVE, store ``S_{t-1}`` of step ``i`` at ``p_save + i * BV * BK + o_save`` first."""
    for i in range(0, n):
        if SAVE:
            tl.store(p_save + i * (BV * BK) + o_save, b_S)
        b_q, b_k, b_g, b_beta = load_token(p_q, p_k, p_g, p_beta, o_k, m_k, b_a, b_dt, scale, lower_bound, DT,
                                           USE_L2NORM, USE_GATE, HAS_A_LOG, USE_LOWER_BOUND, USE_BETA_SIGMOID,
                                           NEG_EIGVAL)
        b_v = tl.load(p_v, mask=m_v, other=0).to(DT)
        b_S = b_S * tl.exp(b_g)[None, :]
        b_p = tl.sum(b_S * b_k[None, :], 1)
        b_S = b_S + (b_beta * (b_v - b_p))[:, None] * b_k[None, :]
        p_q += H * K
        p_k += H * K
        p_g += HV * K
        p_beta += HV
        p_v += HV * V
    return b_S


# ------------------------------------------------------------------------------------------------ kernel


@triton.jit
def recurrent_bwd_kernel(
    q,  # [TOT, H, K]
    k,  # [TOT, H, K]
    v,  # [TOT, HV, V]
    g,  # [TOT, HV, K]
    beta,  # [TOT, HV]
    do,  # [TOT, HV, V]
    dht,  # [N, HV, V, K] (V-first: the caller's layout, or transposed for it) or None
    h0,  # [N, HV, V, K] (V-first, likewise) or None
    dq,  # [NV, TOT, HV, K] partials
    dk,  # [NV, TOT, HV, K] partials
    dv,  # [TOT, HV, V]
    dg,  # [NV, TOT, HV, K] partials
    dbeta,  # [NV, TOT, HV] partials
    dh0,  # [N, HV, K, V] ([N, HV, V, K] with STATE_V_FIRST) or None
    dA,  # [NV, N, HV] partials or None
    ddt,  # [NV, N, HV, K] partials or None
    ckpt,  # [NC, HV, V, K] checkpoints (transposed, like the tiles)
    scratch,  # [N * HV * NV, C, BV, BK]
    cu_seqlens,
    A_log,
    dt_bias,
    scale,
    lower_bound,
    T,  # tokens per sequence (dense) or in the stream (varlen)
    TOT,  # tokens in the stream
    N,
    C,  # checkpoint interval
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DT: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    NV = tl.num_programs(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    n_seg = (eos - bos + C - 1) // C
    # checkpoint slot of the sequence's first segment: unique per segment, below cdiv(TOT, C) + N
    c0 = bos // C + i_n

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    # Tiles are [BV, BK] with K fastest in registers; the compiler takes each loop's layout from the loads that
    # feed it, so every tile read inside the kernel (h0, dht, checkpoints, scratch) is K-contiguous in memory.
    # On sm_90 (K = V = 128, BV = 32, 8 warps) reading h0/dht in their [K, V] layout spilled 256 bytes a thread.
    o_s = i_hv * (K * V) + o_v[:, None] + o_k[None, :] * V  # the tile inside [HV, K, V]
    o_c = i_hv * (K * V) + o_v[:, None] * K + o_k[None, :]  # the tile inside [HV, V, K]
    p_save = scratch + (i_nh * NV + i_v).to(tl.int64) * C * (BV * BK)
    o_save = tl.arange(0, BV)[:, None] * BK + o_k[None, :]
    b_a, b_dt = load_head_params(A_log, dt_bias, i_hv, o_k, m_k, K, DT, HAS_A_LOG, HAS_DT_BIAS)

    # 1. forward over the sequence, checkpointing the state at every segment start
    b_S = tl.zeros([BV, BK], DT)  # [BV, BK]
    if USE_INITIAL_STATE:
        b_S += tl.load(h0 + i_n.to(tl.int64) * (HV * K * V) + o_c, mask=m_s, other=0).to(DT)
    for j in range(0, n_seg):
        t0 = bos + j * C
        tl.store(ckpt + (c0 + j) * (HV * K * V) + o_c, b_S, mask=m_s)
        b_S = forward_steps(b_S, q + (t0 * H + i_h) * K, k + (t0 * H + i_h) * K, g + (t0 * HV + i_hv) * K,
                            beta + t0 * HV + i_hv, v + (t0 * HV + i_hv) * V + o_v, tl.minimum(C, eos - t0),
                            o_k, m_k, m_v, b_a, b_dt, scale, lower_bound, p_save, o_save, H, HV, K, V, BK, BV, DT,
                            USE_L2NORM, USE_GATE, HAS_A_LOG, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL, False)

    # 2. segments last to first: recompute S_{t-1} into the scratch, then walk the tokens backwards
    b_G = tl.zeros([BV, BK], DT)  # [BV, BK] gradient of the current state
    if USE_FINAL_STATE_GRADIENT:
        b_G += tl.load(dht + i_n.to(tl.int64) * (HV * K * V) + o_c, mask=m_s, other=0).to(DT)
    b_dA = tl.zeros([BK], DT)
    b_ddt = tl.zeros([BK], DT)
    for jj in range(0, n_seg):
        j = n_seg - 1 - jj
        t0 = bos + j * C
        n_in = tl.minimum(C, eos - t0)
        b_S = tl.load(ckpt + (c0 + j) * (HV * K * V) + o_c, mask=m_s, other=0)
        forward_steps(b_S, q + (t0 * H + i_h) * K, k + (t0 * H + i_h) * K, g + (t0 * HV + i_hv) * K,
                      beta + t0 * HV + i_hv, v + (t0 * HV + i_hv) * V + o_v, n_in,
                      o_k, m_k, m_v, b_a, b_dt, scale, lower_bound, p_save, o_save, H, HV, K, V, BK, BV, DT,
                      USE_L2NORM, USE_GATE, HAS_A_LOG, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL, True)
        for ii in range(0, n_in):
            i = n_in - 1 - ii
            t = t0 + i
            # the token, with the intermediates of its transforms
            b_qn = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(DT)
            b_kn = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(DT)
            if USE_L2NORM:
                b_qn, b_rq = l2norm_rows(b_qn)
                b_kn, b_rk = l2norm_rows(b_kn)
            b_x = tl.load(g + (t * HV + i_hv) * K + o_k, mask=m_k, other=0).to(DT)
            if USE_GATE:
                b_g = log_decay(b_x + b_dt, b_a, lower_bound, HAS_A_LOG, USE_LOWER_BOUND)
            else:
                b_g = b_x
            b_y = tl.load(beta + t * HV + i_hv).to(DT)
            b_beta = beta_value(b_y, USE_BETA_SIGMOID, NEG_EIGVAL)
            b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0).to(DT)  # [BV]
            b_do = tl.load(do + (t * HV + i_hv) * V + o_v, mask=m_v, other=0).to(DT)  # [BV]
            # the forward step again, from S_{t-1}
            b_decay = tl.exp(b_g)
            b_St = tl.load(p_save + i * (BV * BK) + o_save) * b_decay[None, :]  # [BV, BK]
            b_r = b_v - tl.sum(b_St * b_kn[None, :], 1)  # [BV]  v - p
            b_e = b_beta * b_r
            b_S = b_St + b_e[:, None] * b_kn[None, :]
            # its gradients
            b_G += b_do[:, None] * (scale * b_qn)[None, :]
            b_dqn = scale * tl.sum(b_S * b_do[:, None], 0)  # [BK]
            b_de = tl.sum(b_G * b_kn[None, :], 1)  # [BV]
            b_dp = -b_beta * b_de
            b_dkn = tl.sum(b_G * b_e[:, None] + b_St * b_dp[:, None], 0)  # [BK]
            b_dv = b_beta * b_de
            b_dbeta = tl.sum(b_de * b_r, 0)
            b_dSt = b_G + b_dp[:, None] * b_kn[None, :]
            b_dg = tl.sum(b_dSt * b_St, 0)  # [BK]
            b_G = b_dSt * b_decay[None, :]
            # chain rules to the raw inputs (linear, so per partial)
            if USE_L2NORM:
                b_dqn = l2norm_bwd(b_qn, b_rq, b_dqn, 0)
                b_dkn = l2norm_bwd(b_kn, b_rk, b_dkn, 0)
            if USE_GATE:
                b_dg, b_dA_terms = gate_bwd(b_x, b_g, b_a, b_dt, b_dg, lower_bound, HAS_A_LOG, USE_LOWER_BOUND)
                b_dA += tl.where(m_k, b_dA_terms, 0)
                b_ddt += tl.where(m_k, b_dg, 0)
            b_dbeta = beta_bwd(b_y, b_dbeta, USE_BETA_SIGMOID, NEG_EIGVAL)
            o_p = ((i_v * TOT + t) * HV + i_hv) * K + o_k
            tl.store(dq + o_p, b_dqn, mask=m_k)
            tl.store(dk + o_p, b_dkn, mask=m_k)
            tl.store(dg + o_p, b_dg, mask=m_k)
            tl.store(dbeta + (i_v * TOT + t) * HV + i_hv, b_dbeta)
            tl.store(dv + (t * HV + i_hv) * V + o_v, b_dv.to(dv.dtype.element_ty), mask=m_v)

    # 3. the gradient of the initial state, and the per-program sums for the gate parameters
    if USE_INITIAL_STATE:
        if STATE_V_FIRST:
            tl.store(dh0 + i_n.to(tl.int64) * (HV * K * V) + o_c, b_G.to(dh0.dtype.element_ty), mask=m_s)
        else:
            tl.store(dh0 + i_n.to(tl.int64) * (HV * K * V) + o_s, b_G.to(dh0.dtype.element_ty), mask=m_s)
    if HAS_A_LOG:
        tl.store(dA + (i_v * N + i_n) * HV + i_hv, tl.sum(b_dA, 0))
    if HAS_DT_BIAS:
        tl.store(ddt + ((i_v * N + i_n) * HV + i_hv) * K + o_k, b_ddt, mask=m_k)


# ---------------------------------------------------------------------------------------------- launcher


def _partials(NV: int, shape: tuple[int, ...], like: Tensor, dtype: torch.dtype) -> Tensor:
    """A buffer for ``NV`` per-tile partials of ``shape`` (exactly ``shape`` when there is one tile)."""
    return like.new_empty((NV, *shape) if NV > 1 else shape, dtype=dtype)


def _reduce(x: Tensor, NV: int, group: tuple[int, int] | None = None) -> Tensor:
    """Sum the per-tile partials (dim 0 when NV > 1) and, given ``(H, G)``, the value heads of each q/k head."""
    if NV > 1:
        x = x.sum(0)
    if group is not None and group[1] > 1:
        H, G = group
        x = x.unflatten(2, (H, G)).sum(3)
    return x


def _v_first(state: Tensor, state_v_first: bool) -> Tensor:
    """A state tensor as the kernel reads it, ``[N, HV, V, K]`` contiguous: as given in the V-first layout, else
    a transposed copy."""
    return contiguous(state) if state_v_first else state.transpose(-1, -2).contiguous()


def recurrent_bwd(
    do: Tensor,
    dht: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The kernel of ``kda::recurrent_bwd``: ``(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)``, None where absent."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    TOT = B * T
    BK, BV, num_warps = recurrent_bwd_config(K, V)
    NV = (V + BV - 1) // BV
    C = checkpoint_interval(TOT, N)
    f = state_dtype(v)
    has_A = opts.use_gate and A_log is not None
    has_dt = opts.use_gate and dt_bias is not None

    dq = _partials(NV, (B, T, HV, K), v, f)
    dk = _partials(NV, (B, T, HV, K), v, f)
    dg = _partials(NV, (B, T, HV, K), v, f)
    dbeta = _partials(NV, (B, T, HV), v, f)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dh0 = None if initial_state is None else torch.empty_like(initial_state, memory_format=torch.contiguous_format)
    dA = v.new_empty((NV, N, HV), dtype=f) if has_A else None
    ddt = v.new_empty((NV, N, HV, K), dtype=f) if has_dt else None
    ckpt = v.new_empty(((TOT + C - 1) // C + N, HV, V, K), dtype=f)
    scratch = v.new_empty((N * HV * NV, C, BV, BK), dtype=f)
    poison(dq, dk, dg, dbeta, dv, dh0, dA, ddt, ckpt, scratch)
    if N * HV > 0:
        recurrent_bwd_kernel[(N * HV, NV)](
            contiguous(q), contiguous(k), contiguous(v), contiguous(g), contiguous(beta), contiguous(do),
            None if dht is None else _v_first(dht, opts.state_v_first),
            None if initial_state is None else _v_first(initial_state, opts.state_v_first),
            dq, dk, dv, dg, dbeta, dh0, dA, ddt, ckpt, scratch,
            cu_seqlens, A_log if has_A else None, dt_bias if has_dt else None,
            scale, 0.0 if opts.lower_bound is None else opts.lower_bound, T, TOT, N, C,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, DT=compute_dtype(v),
            USE_L2NORM=opts.use_qk_l2norm,
            USE_GATE=opts.use_gate,
            HAS_A_LOG=has_A,
            HAS_DT_BIAS=has_dt,
            USE_LOWER_BOUND=opts.lower_bound is not None,
            USE_BETA_SIGMOID=opts.use_beta_sigmoid,
            NEG_EIGVAL=opts.allow_neg_eigval,
            USE_INITIAL_STATE=initial_state is not None,
            USE_FINAL_STATE_GRADIENT=dht is not None,
            IS_VARLEN=cu_seqlens is not None,
            STATE_V_FIRST=opts.state_v_first,
            num_warps=num_warps,
        )  # fmt: skip
    return (
        _reduce(dq, NV, (H, HV // H)).to(q.dtype),
        _reduce(dk, NV, (H, HV // H)).to(k.dtype),
        dv,
        _reduce(dg, NV).to(g.dtype),
        _reduce(dbeta, NV).to(beta.dtype),
        dh0,
        None if dA is None or A_log is None else dA.sum((0, 1)).to(A_log.dtype),
        None if ddt is None or dt_bias is None else ddt.sum((0, 1)).flatten().to(dt_bias.dtype),
    )
