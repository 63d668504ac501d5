"""The chunkwise KDA backward in Triton: the driver of the backward stages (``docs/math.md``, "Chunk backward").

Per value head, chunks of ``BT = 64`` tokens, the forward's notation (:mod:`kda_ops.triton.chunk.forward`)::

    q, k, g, beta  <- the options (l2norm, gate, beta sigmoid), in torch              (inputs)
    Mqk, Qt, Kend, Gam_last, Tm, W, Hin, E  <- the forward, recomputed (recompute), or kept by the
                                               training forward (chunk_fwd_train, kda::chunk_train)
    dS' (per chunk), dE = Kend dS' + Mqk^T dO, dS = e^{Gam_last} dS' + Qt^T dO - W^T dE
                                                    reverse scan; dh0 = dS            (scan_bwd)
    dv, dMqk, dMkk = -tril(Tm^T dT Tm^T), dKt, dbeta (through U, W, Tm)                (dv)
    dq, dk, dg = revcumsum(dGam), dbeta (through Mqk, Mkk, Qt, Kt, Kend, e^{Gam_last}) (dqk)
    dq, dk summed over each group of value heads; chain rules of the options          (inputs)
    (the l2norm's in the dq/dk stage's epilogue where one value head per key head and K <= 128)

Nothing reads a value on the host and every allocation is shaped by ``T``, ``N`` and the head sizes: the chunk-slot
map (:func:`kda_ops.triton.chunk.slots.slot_map`) is static, the scan reads ``cu_seqlens`` on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.common import Options, state_dtype, state_shape
from kda_ops.triton.chunk.dqk import chunk_bwd_dqk, norm_in_epilogue
from kda_ops.triton.chunk.dv import chunk_bwd_dv
from kda_ops.triton.chunk.inputs import transform_inputs, transform_inputs_bwd
from kda_ops.triton.chunk.recompute import (
    Recomputed,
    chunk_bwd_recompute,
    recompute_precision,
)
from kda_ops.triton.chunk.scan_bwd import chunk_bwd_scan
from kda_ops.triton.chunk.slots import slot_map
from kda_ops.triton.launch import contiguous, flat, interpreting
from kda_ops.varlen import flat_cu_seqlens


def product_precisions(dtype: torch.dtype) -> tuple[str, str, str]:
    """``(PREC, PREC_T, PREC_DQK)`` of the gradient kernels: the products of the reverse scan and the dv stage, the
    dv stage's ``X E^T`` (the gradient through the inverse ``Tm``), and the dq/dk stage's.

    fp64 exact; fp32 3xTF32 (~2e-7 a product); 16-bit tf32 (~3e-4 a product, within the 8e-3 budget of the gradients),
    3xTF32 through the inverse (the error hot spot). fp16 rounds fp32 operands to nearest TF32 rather than letting the
    tensor cores cut them toward zero (``"tf32rn"``: dv at B1 T4096 H4 K = V = 256 4.3e-4 against 8.8e-4 on the H200),
    and takes 2xTF32 (:func:`~kda_ops.triton.lang.mm`) in the dq/dk stage's products through ``dMqk``, ``dMkk``, whose
    dg the gate's gradients (dA_log, dt_bias) sum over many tokens with cancellation: TF32 there left dt_bias's gradient
    of a packed fp16 row with an in-kernel gate at 7.6e-3 against float64 on the H200, over the 5e-3 bound (3xTF32 there
    spills 760 B or more per thread). The stage's products with the states take fp16 operands, which TF32 holds exactly.
    The interpreter computes all in exact fp32.
    No product rounds its operands to bf16 (only operands already stored in bf16 take bf16 products, exactly):
    in the reverse scan the state gradient grows without decay under zero gates and its rounding takes gradients
    over the GPU tests' bounds, and bf16 products in every gradient kernel put dg at B1 T1000 H32 bf16 at 5.50e-3
    against 1.83e-3 with TF32.
    """
    if dtype == torch.float64 or interpreting():
        return "ieee", "ieee", "ieee"
    if dtype == torch.float32:
        return "tf32x3", "tf32x3", "tf32x3"
    if dtype == torch.float16:
        return "tf32rn", "tf32x3", "tf32x2"
    return "tf32", "tf32x3", "tf32"


# (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)
Grads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]


def chunk_bwd(
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
) -> Grads:
    """``(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)``: the signature of ``reference.chunk_bwd``.

    Gradients in the dtypes of their inputs (dh0 in the initial state's); None where an input is absent.
    ``dht`` (``[N, HV, K, V]``, ``[N, HV, V, K]`` with ``opts.state_v_first`` as ``dh0``; None or empty: zero) is
    the gradient of the final state. The forward's factors are
    recomputed here (the kernel of ``kda::chunk_bwd``, after ``kda::chunk``, which saves only its inputs).
    """
    return _gradients(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts, None)


def chunk_bwd_saved(
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
    saved: tuple[Tensor, ...],
) -> Grads:
    """The kernel of ``kda::chunk_bwd_saved``: :func:`chunk_bwd` on the factors that :func:`chunk_fwd_train` kept
    (``saved = (Mqk, Qt, Kend, Gl, Tm, W, Hin, E, norms)``) instead of recomputing them."""
    return _gradients(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts, saved)


def _gradients(
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
    saved: tuple[Tensor, ...] | None,
) -> Grads:
    """The backward stages on the forward's factors: recomputed when ``saved`` is None, else those given."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = state_dtype(v)
    G = HV // H
    if dht is not None and dht.numel() == 0:
        dht = None
    qf, kf, vf, gf, bf = (flat(x) for x in (q, k, v, g, beta))
    qp, kp, gp, bp, norms = transform_inputs(qf, kf, gf, bf, A_log, dt_bias, opts, dt, with_norms=saved is None)
    if saved is not None and opts.use_qk_l2norm:
        norms = saved[8]
    dO = flat(do)
    norm_done = False
    if B * T == 0:
        N = flat_cu_seqlens(cu_seqlens, B, T, v.device).shape[0] - 1
        zq, zk, zg, zb = (torch.zeros_like(x, dtype=dt) for x in (qf, kf, gf, bf))
        dv_t = torch.zeros_like(vf, dtype=dt)
        shape = state_shape(N, HV, K, V, opts.state_v_first)
        dh0: Tensor = torch.zeros(shape, dtype=dt, device=v.device) if dht is None else dht.to(dt, copy=True)
    else:
        slots = slot_map(cu_seqlens, B, T, v.device)
        cu = slots.cu
        h0 = None if initial_state is None else contiguous(initial_state.to(dt))
        prec, prec_t, prec_dqk = product_precisions(v.dtype)
        rp = recompute_precision(v.dtype)
        if saved is None:
            fw = chunk_bwd_recompute(
                q=qp, k=kp, v=vf, g=gp, beta=bp, scale=scale, h0=h0, cu=cu, slots=slots, precision=rp,
                offsets=slots.offset, norms=norms, state_v_first=opts.state_v_first,
            )  # fmt: skip
        else:
            fw = Recomputed(*saved[:8])
        dht_c = None if dht is None else dht.to(dt)
        # dS', dMqk, dMkk, dKt through memory in the factors' storage dtype (bf16 for bf16 inputs): each is written
        # once and read once, never carried (the reverse scan, the dv stage)
        store = rp.store
        if prec_dqk == "tf32x2" and store not in (torch.float16, torch.bfloat16):
            prec_dqk = prec  # its first operands, dMqk and dMkk, are exact in TF32 only when stored in 16 bits
        dE, dSp, dh0_ = chunk_bwd_scan(
            dO=dO, Mqk=fw.Mqk, Qt=fw.Qt, Kend=fw.Kend, W=fw.W, Gl=fw.Gl, dht=dht_c, cu=cu, prec=prec,
            store_dh0=initial_state is not None, offsets=slots.offset, dsp_dtype=store,
            state_v_first=opts.state_v_first, slots=slots,
        )  # fmt: skip
        # each recomputed intermediate is dropped after its last reader, so that the caching allocator reuses its
        # memory for the next stage's outputs: Mqk, Qt, Kend and W after the scan, Tm and dE after the dv stage
        # (docs/architecture.md, "Chunk backward: what is saved"); saved ones live on in the autograd graph until
        # the backward returns
        Tm, Hin, E, Gl = fw.Tm, fw.Hin, fw.E, fw.Gl
        del fw
        dv_t, dbeta_p, dMqk, dMkk, dKt, Gam = chunk_bwd_dv(
            k=kp, v=vf, g=gp, beta=bp, Tm=Tm, Hin=Hin, E=E, dE=dE, dO=dO, slots=slots, prec=prec, prec_t=prec_t,
            dv_dtype=v.dtype, store=store, norms=norms,
        )  # fmt: skip
        del Tm, dE
        # where it can, the stage applies the l2norm's gradient itself (no pass over dq, dk after it)
        norm_done = norms is not None and norm_in_epilogue(H, HV, K) and q.dtype == k.dtype
        dq_v, dk_v, zg, zb = chunk_bwd_dqk(
            q=qp, k=kp, Gam=Gam, Gl=Gl, beta=bp, dMqk=dMqk, dMkk=dMkk, dKt=dKt, Hin=Hin, E=E, dSp=dSp, dO=dO,
            dbeta_partial=dbeta_p, scale=scale, slots=slots, prec=prec_dqk, norms=norms, prec_state=prec,
            norm_dtype=q.dtype if norm_done else None, g=gp,
        )  # fmt: skip
        dh0 = dh0_ if dh0_ is not None else dSp.new_empty(0)
        del Hin, E, dSp, dMqk, dMkk, dKt
        # a group's value heads share their q/k head (without groups the view is the sum: no pass over the tensor)
        zq = dq_v if G == 1 else dq_v.view(B * T, H, G, K).sum(2)
        zk = dk_v if G == 1 else dk_v.view(B * T, H, G, K).sum(2)
    dq, dk, dg, dbeta, dA, ddt = transform_inputs_bwd(
        qf, kf, gf, bf, A_log, dt_bias, opts, zq, zk, zg, zb, norm_done=norm_done
    )  # fmt: skip
    return (
        dq.view_as(q).to(q.dtype),
        dk.view_as(k).to(k.dtype),
        dv_t.view_as(v).to(v.dtype),
        dg.view_as(g).to(g.dtype),
        dbeta.view_as(beta).to(beta.dtype),
        None if initial_state is None else dh0.to(initial_state.dtype),
        None if dA is None or A_log is None else dA.to(A_log.dtype),
        None if ddt is None or dt_bias is None else ddt.to(dt_bias.dtype),
    )


__all__ = ["chunk_bwd", "chunk_bwd_saved", "product_precisions"]
