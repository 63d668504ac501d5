"""The fused recurrent KDA kernel (``docs/math.md``, "The recurrence"): decode, short sequences, a serving pool.

One program per (sequence, value head, value tile). The program holds a ``[BK, BV]`` tile of the state ``S [K, V]``
in registers (fp32; fp64 for fp64 inputs) and walks its sequence's tokens in order::

    S = S * exp(g_t)[:, None]           forget, per key channel
    p = sum_k S * k_t                   predict           [BV]
    e = beta_t * (v_t - p)              corrected error   [BV]
    S = S + k_t[:, None] * e[None, :]   write
    o_t = sum_k S * (scale * q_t)       read after write  [BV]

The in-kernel transforms (l2norm of q and k, the gate, the beta sigmoid) are applied per token as each token is
loaded, with the formulas of :mod:`kda_ops.triton.lang`; ``BK = next_power_of_2(K)`` covers the whole key dimension,
so the l2norm sum over K is local to the program. Padded key rows carry zero keys, so they stay zero.

Sequences: a dense batch ``[B, T]`` (sequence ``n`` is tokens ``n*T ..``) or packed by ``cu_seqlens``, read on the
device; only ``N``, ``HV`` and ``V`` shape the grid, so one CUDA graph serves every ``cu_seqlens`` of one length.
The serving entry point reads and writes the state at ``state_indices[n]`` of a pool (slot -1: padding).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import Options, forward_outputs
from kda_ops.triton.lang import beta_value, log_decay, rnorm
from kda_ops.triton.launch import Launcher, contiguous, poison, recurrent_config

# ------------------------------------------------------------------------------------------- jit helpers


@triton.jit
def sequence_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """First token and one past the last token of sequence ``i_n`` in the flat token stream (int64).

    Values that break the ``cu_seqlens`` contract are clamped into ``[0, T]`` so that nothing reads out of bounds.
    """
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        bos = tl.minimum(tl.maximum(bos, 0), T)
        eos = tl.minimum(tl.maximum(eos, bos), T)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def load_head_params(A_log, dt_bias, i_hv, o_k, m_k, K: tl.constexpr, DT: tl.constexpr,
                     HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """``exp(A_log[hv])`` (a scalar, 1 without A_log) and ``dt_bias[hv]`` (``[BK]``, zeros without dt_bias)."""
    if HAS_A_LOG:
        b_a = tl.exp(tl.load(A_log + i_hv).to(DT))
    else:
        b_a = tl.full([], 1.0, DT)
    if HAS_DT_BIAS:
        b_dt = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0).to(DT)
    else:
        b_dt = tl.zeros(o_k.shape, DT)
    return b_a, b_dt


@triton.jit
def l2norm_rows(x):
    """``x`` l2-normalised over the key dimension, and its factor ``r`` (:func:`~kda_ops.triton.lang.rnorm`)."""
    r = rnorm(tl.sum(x * x, 0))
    return x * r, r


@triton.jit
def load_token(p_q, p_k, p_g, p_beta, o_k, m_k, b_a, b_dt, scale, lower_bound, DT: tl.constexpr,
               USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
               USE_LOWER_BOUND: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """One token's ``scale * q``, ``k``, log decay ``g`` (all ``[BK]``) and ``beta`` (a scalar), transformed."""
    xq, xk, xg, xb = token_loads(p_q, p_k, p_g, p_beta, o_k, m_k, True)
    return token_transform(xq, xk, xg, xb, b_a, b_dt, scale, lower_bound, DT, USE_L2NORM, USE_GATE, HAS_A_LOG,
                           USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL)  # fmt: skip


@triton.jit
def token_loads(p_q, p_k, p_g, p_beta, o_k, m_k, has):
    """One token's ``q``, ``k``, ``g`` (``[BK]``) and ``beta`` as stored, nothing read unless ``has`` (a scalar)."""
    m = m_k & (o_k * 0 == tl.where(has, 0, 1))  # [BK]: triton 3.9's interpreter rejects tensor & scalar masks
    xq = tl.load(p_q + o_k, mask=m, other=0)
    xk = tl.load(p_k + o_k, mask=m, other=0)
    xg = tl.load(p_g + o_k, mask=m, other=0)
    xb = tl.load(p_beta, mask=has, other=0)
    return xq, xk, xg, xb


@triton.jit
def token_transform(xq, xk, xg, xb, b_a, b_dt, scale, lower_bound, DT: tl.constexpr, USE_L2NORM: tl.constexpr,
                    USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                    USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """:func:`load_token` after the loads: the in-kernel l2norm, gate and beta sigmoid."""
    b_q = xq.to(DT)
    b_k = xk.to(DT)
    b_g = xg.to(DT)
    b_beta = beta_value(xb.to(DT), USE_BETA_SIGMOID, NEG_EIGVAL)
    if USE_L2NORM:
        b_q, _ = l2norm_rows(b_q)
        b_k, _ = l2norm_rows(b_k)
    if USE_GATE:
        # padded key rows get a finite decay; their state rows are zero and stay zero
        b_g = log_decay(b_g + b_dt, b_a, lower_bound, HAS_A_LOG, USE_LOWER_BOUND)
    return b_q * scale, b_k, b_g, b_beta


# ------------------------------------------------------------------------------------------------ kernel


# No specialisation on the length ``T`` or the pool's slot count ``NS``: Triton would otherwise compile a kernel for
# T == 1 (a decode step), for T divisible by 16 and for any other T (a 3-token speculative step), each a compile a
# CUDA-graph capture after a warm-up could meet. One form serves every length (B = 64 decode under a CUDA graph on an
# H200: 72.5 -> 71.5 µs).
@triton.jit(do_not_specialize=["T", "NS", "NSPEC"])
def recurrent_fwd_kernel(
    q,  # [B*T, H, K]
    k,  # [B*T, H, K]
    v,  # [B*T, HV, V]
    g,  # [B*T, HV, K]
    beta,  # [B*T, HV]
    o,  # [B*T, HV, V]
    h0,  # [N, HV, K, V] ([N, HV, V, K] with STATE_V_FIRST), or the pool [S, HV, ...] with state indices
    ht,  # like h0 (the same pool with state indices)
    cu_seqlens,  # [N + 1] or None
    state_indices,  # [N], [N, NSPEC] (SPEC) or None
    num_accepted,  # [N] or None (SPEC: the column of each sequence's first slot, plus one)
    A_log,  # [HV] or None
    dt_bias,  # [HV * K] or None
    scale,
    lower_bound,
    T,  # tokens per sequence (dense) or in the stream (varlen)
    NS,  # slots in the pool (state indices outside [0, NS) are padding)
    NSPEC,  # SPEC: the columns of state_indices (slots for the states after each of the first NSPEC tokens)
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
    STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
    SPEC: tl.constexpr = False,
    HAS_ACCEPTED: tl.constexpr = False,
):
    # one grid axis, the value tiles of one state adjacent: the halves of each state row are read and written
    # together (DRAM pages opened once), and the grid is not bounded by the 65535 of the other axes
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_nh, i_v = pid // NV, pid % NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    p_q = q + (bos * H + i_h) * K
    p_k = k + (bos * H + i_h) * K
    p_g = g + (bos * HV + i_hv) * K
    p_beta = beta + bos * HV + i_hv
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_o = o + (bos * HV + i_hv) * V + o_v
    # The first token's loads go out before anything else, the next token's while this one computes: with state
    # indices the state's address waits for the slot's load, and the token's loads should not queue behind it.
    has = eos > bos
    xq, xk, xg, xb = token_loads(p_q, p_k, p_g, p_beta, o_k, m_k, has)
    xv = tl.load(p_v, mask=m_v & (o_v * 0 == tl.where(has, 0, 1)), other=0)
    if SPEC:  # the first slot is in column num_accepted[n] - 1 (0 without num_accepted)
        if HAS_ACCEPTED:
            col = tl.load(num_accepted + i_n).to(tl.int64) - 1
        else:
            col = i_n.to(tl.int64) * 0
        col_ok = (col >= 0) & (col < NSPEC)
        slot = tl.load(state_indices + i_n * NSPEC + tl.where(col_ok, col, 0)).to(tl.int64)
        valid = col_ok & (slot >= 0) & (slot < NS)
        slot = tl.where(valid, slot, 0)
        n_tok = tl.where(valid, eos - bos, 0)
        m_v_s = o_v < tl.where(valid, V, 0)
    elif USE_STATE_INDICES:
        slot = tl.load(state_indices + i_n).to(tl.int64)
        valid = (slot >= 0) & (slot < NS)
        slot = tl.where(valid, slot, 0)
        n_tok = tl.where(valid, eos - bos, 0)
        # a padding sequence masks its whole state tile (bounds, not `& valid`: triton 3.9's interpreter rejects
        # a mask made from a tensor and a scalar)
        m_v_s = o_v < tl.where(valid, V, 0)
    else:
        slot = i_n.to(tl.int64)
        n_tok = eos - bos
        m_v_s = m_v
    # the tile in the states' layout; the registers hold it [BK, BV] either way. STATE_V_FIRST spills 24 B a thread
    # in the serving step with every option (8 B plain; sm_90, K = V = 128), whether it is addressed [BK, BV] or
    # read [BV, BK] and transposed in registers
    if STATE_V_FIRST:
        o_t = o_v[None, :] * K + o_k[:, None]
    else:
        o_t = o_k[:, None] * V + o_v[None, :]
    o_s = (slot * HV + i_hv) * (K * V) + o_t
    m_s = m_k[:, None] & m_v_s[None, :]

    b_S = tl.zeros([BK, BV], DT)  # [BK, BV]
    if USE_INITIAL_STATE:
        b_S += tl.load(h0 + o_s, mask=m_s, other=0).to(DT)
    b_a, b_dt = load_head_params(A_log, dt_bias, i_hv, o_k, m_k, K, DT, HAS_A_LOG, HAS_DT_BIAS)

    for i in range(0, n_tok):
        b_q, b_k, b_g, b_beta = token_transform(xq, xk, xg, xb, b_a, b_dt, scale, lower_bound, DT, USE_L2NORM,
                                                USE_GATE, HAS_A_LOG, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL)
        b_v = xv.to(DT)  # [BV]
        p_q += H * K
        p_k += H * K
        p_g += HV * K
        p_beta += HV
        p_v += HV * V
        has = i + 1 < n_tok
        xq, xk, xg, xb = token_loads(p_q, p_k, p_g, p_beta, o_k, m_k, has)
        xv = tl.load(p_v, mask=m_v & (o_v * 0 == tl.where(has, 0, 1)), other=0)
        b_S = b_S * tl.exp(b_g)[:, None]
        b_p = tl.sum(b_S * b_k[:, None], 0)  # [BV]
        b_e = b_beta * (b_v - b_p)  # [BV]
        b_S = b_S + b_k[:, None] * b_e[None, :]
        b_o = tl.sum(b_S * b_q[:, None], 0)  # [BV]
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)
        p_o += HV * V
        if SPEC and STORE_FINAL_STATE:  # the state after token i into slot state_indices[n, i]
            s_i = tl.load(state_indices + i_n * NSPEC + i, mask=i < NSPEC, other=-1).to(tl.int64)
            ok_i = (s_i >= 0) & (s_i < NS)
            p_i = ht + (tl.where(ok_i, s_i, 0) * HV + i_hv) * (K * V) + o_t
            tl.store(p_i, b_S.to(ht.dtype.element_ty), mask=m_k[:, None] & (o_v < tl.where(ok_i, V, 0))[None, :])
    if USE_STATE_INDICES or SPEC:
        # a padding sequence (its loop above ran no step): its output rows are zeros
        for _ in range(0, (eos - bos) - n_tok):
            tl.store(p_o, tl.zeros([BV], DT).to(p_o.dtype.element_ty), mask=m_v)
            p_o += HV * V
    if STORE_FINAL_STATE and not SPEC:
        tl.store(ht + o_s, b_S.to(ht.dtype.element_ty), mask=m_s)


# --------------------------------------------------------------------------------------------- launchers

_launch_fwd = Launcher(recurrent_fwd_kernel)


def launch_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    o: Tensor,
    h0: Tensor | None,
    ht: Tensor | None,
    cu_seqlens: Tensor | None,
    state_indices: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    scale: float,
    opts: Options,
    num_accepted: Tensor | None = None,
) -> None:
    """Run :func:`recurrent_fwd_kernel` writing ``o`` (and ``ht``); inputs of the public contract's shapes.
    ``state_indices [N, T_spec]``: the speculative step (``SPEC``), ``ht`` written after each token."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if N * HV == 0 or (o.numel() == 0 and ht is None):
        return
    NV, meta, key = _forward_meta(
        H, HV, K, V, v.dtype == torch.float64, opts, A_log is not None, dt_bias is not None, h0 is not None,
        ht is not None, cu_seqlens is not None, state_indices is not None,
        state_indices is not None and state_indices.dim() == 2, num_accepted is not None,
        _state_bytes(h0, ht),
    )  # fmt: skip
    _launch_fwd(
        (N * HV * NV,),
        (contiguous(q), contiguous(k), contiguous(v), contiguous(g), contiguous(beta), o,
         h0, ht, cu_seqlens, state_indices, num_accepted, A_log, dt_bias,
         scale, 0.0 if opts.lower_bound is None else opts.lower_bound,
         T, 0 if h0 is None else h0.shape[0],
         state_indices.shape[1] if state_indices is not None and state_indices.dim() == 2 else 0),
        meta, key,
    )  # fmt: skip


def _state_bytes(h0: Tensor | None, ht: Tensor | None) -> int:
    """Bytes per element of the states the kernel reads or writes (0 without either: no layout to tile for)."""
    for s in (h0, ht):
        if s is not None:
            return s.element_size()
    return 0


@functools.cache
def _forward_meta(
    H: int, HV: int, K: int, V: int, fp64: bool, opts: Options, has_A_log: bool, has_dt_bias: bool,
    has_h0: bool, has_ht: bool, varlen: bool, indexed: bool, spec: bool = False, accepted: bool = False,
    state_bytes: int = 4,
) -> tuple[int, dict[str, Any], tuple[Any, ...]]:  # fmt: skip
    """The number of value tiles, the constexpr arguments of one launch and a hashable key that determines them,
    computed once per configuration (the eager decode call is dominated by host overhead)."""
    BK, BV, num_warps = recurrent_config(K, V, opts.state_v_first, state_bytes)
    key = (H, HV, K, V, fp64, opts, has_A_log, has_dt_bias, has_h0, has_ht, varlen, indexed, spec, accepted, BK, BV,
           num_warps)  # fmt: skip
    meta = dict(
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, DT=tl.float64 if fp64 else tl.float32,
        USE_L2NORM=opts.use_qk_l2norm,
        USE_GATE=opts.use_gate,
        HAS_A_LOG=has_A_log,
        HAS_DT_BIAS=has_dt_bias,
        USE_LOWER_BOUND=opts.lower_bound is not None,
        USE_BETA_SIGMOID=opts.use_beta_sigmoid,
        NEG_EIGVAL=opts.allow_neg_eigval,
        USE_INITIAL_STATE=has_h0,
        STORE_FINAL_STATE=has_ht,
        IS_VARLEN=varlen,
        USE_STATE_INDICES=indexed and not spec,
        STATE_V_FIRST=opts.state_v_first,
        SPEC=spec,
        HAS_ACCEPTED=accepted,
        num_warps=num_warps,
    )  # fmt: skip
    return (V + BV - 1) // BV, meta, key


def recurrent_fwd(
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
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """The kernel of ``kda::recurrent``: ``o [B, T, HV, V]`` in v's dtype, the final state or ``(0,)``; states in
    the layout of ``opts.state_v_first``."""
    o, ht = forward_outputs(q, v, cu_seqlens, output_final_state, opts.state_v_first)
    poison(o, ht)
    h0 = None if initial_state is None else contiguous(initial_state)
    launch_forward(q, k, v, g, beta, o, h0, ht if output_final_state else None, cu_seqlens, None, A_log, dt_bias,
                   scale, opts)  # fmt: skip
    return o, ht


def recurrent_update(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float,
    cu_seqlens: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    opts: Options,
    num_accepted_tokens: Tensor | None = None,
    write_states: bool = True,
) -> Tensor:
    """The kernel of ``kda::recurrent_update_``: updates ``state_pool`` in place at ``state_indices``, returns o.
    ``state_indices [N, T_spec]``: the speculative step (the state after each token into its own slot, from the
    slot of column ``num_accepted_tokens[n] - 1``); ``write_states=False``: the pool only read.
    The pool is ``[S, HV, V, K]`` with ``opts.state_v_first`` (read and written in that layout: no transposed copy),
    else ``[S, HV, K, V]``.

    The pool must be contiguous (the public function checks it): a copy would not update the caller's pool.
    Each program reads and writes only its own tile of its own slot, so updating in place is race-free as long
    as no two sequences share a slot.
    """
    o = forward_outputs(q, v, cu_seqlens, False)[0]
    poison(o)
    launch_forward(q, k, v, g, beta, o, state_pool, state_pool if write_states else None, cu_seqlens,
                   contiguous(state_indices), A_log, dt_bias, scale, opts,
                   None if num_accepted_tokens is None else contiguous(num_accepted_tokens))  # fmt: skip
    return o
