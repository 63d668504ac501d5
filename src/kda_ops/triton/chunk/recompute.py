"""Backward stage 1: recompute the forward's per-chunk factors from the (prepared) inputs.

The forward op saves only its inputs (``docs/architecture.md``, "Chunk backward: what is saved"); the backward
reruns the forward's kernels, keeping what the gradient stages read::

    Mqk, Qt, Kend, Gam_last, Tm, W, U   (chunk_prepare_recompute: stages 1-3 fused, as in the forward)
    Hin, E                              (the scan: the state entering each chunk, the errors)

One fused kernel, which never writes ``Mkk``, forms the first line: ~2.9 ms at B1 T32768 H32 bf16 on an H200 with
``Tm`` stored, against 1.62 + 1.70 ms for the intra stage and the solve as kernels of their own.

The inputs are prepared in torch (:mod:`~kda_ops.triton.chunk.inputs`), so the stages run without in-kernel
options. ``Tm``, ``Mqk`` and ``Gam_last`` are stored in the compute dtype (fp32): the gradients chain several
products of them; ``W``, ``Qt``, ``Kend``, ``Hin`` and ``E`` in :func:`recompute_precision`'s storage dtype (bf16 for
bf16 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import state_dtype
from kda_ops.triton.chunk.precision import Precision, precision_for
from kda_ops.triton.chunk.prepare import chunk_prepare_recompute
from kda_ops.triton.chunk.scan import chunk_state
from kda_ops.triton.chunk.tiles import BT
from kda_ops.triton.launch import Launcher
from kda_ops.varlen import SlotRows, num_chunk_slots


@dataclass
class Recomputed:
    """The forward's factors, flat (``[T, HV, ...]``) or per slot (``[NC, HV, ...]``)."""

    Mqk: Tensor  # [T, HV, BT]
    Qt: Tensor  # [T, HV, K]
    Kend: Tensor  # [T, HV, K]
    Gl: Tensor  # [NC, HV, K]
    Tm: Tensor  # [T, HV, BT]
    W: Tensor  # [T, HV, K]
    Hin: Tensor  # [NC, HV, K, V]
    E: Tensor  # [T, HV, V]

    def tensors(self) -> tuple[Tensor, ...]:
        """The factors in field order (``kda::chunk_train``'s outputs after ``o`` and the final state)."""
        return self.Mqk, self.Qt, self.Kend, self.Gl, self.Tm, self.W, self.Hin, self.E


def recompute_precision(dtype: torch.dtype) -> Precision:
    """The forward stages' precision in the backward. fp32 inputs: fp32 storage, exact or 3xTF32 products. 16-bit
    inputs: the forward's own choice (factors in the input's dtype; for bf16, bf16 products in the scan and the output
    and TF32 elsewhere; for fp16, TF32 with rounded operands, 3xTF32 in Mqk and Mkk). The exact fp32 solve of fp32
    inputs compiles for sm_90 to CUDA-core products that spill (ptxas, K = V = 128): fp32 inputs trade that time for
    their 1e-4 bound."""
    if dtype == torch.float64:
        return Precision(store=torch.float64)
    if dtype == torch.float32:
        return Precision(scan="tf32x3", output="tf32x3", store=torch.float32)
    return precision_for(dtype)


def chunk_bwd_recompute(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    h0: Tensor | None,
    cu: Tensor,
    slots: SlotRows,
    precision: Precision,
    offsets: Tensor | None = None,
    norms: Tensor | None = None,
    final: Tensor | None = None,
    state_v_first: bool = False,
) -> Recomputed:
    """Prepared ``q, k [T, H, K]``, ``v [T, HV, V]``, log decay ``g [T, HV, K]``, ``beta [T, HV]``; ``h0`` in the
    compute dtype or None; ``cu`` the sanitized flat ``cu_seqlens`` and ``slots`` its chunk map; ``norms [2, T, H]``
    the l2norm factors of q and k (raw then) or None. Writes the final state into ``final`` when given (the
    training forward, :func:`~kda_ops.triton.chunk.forward.chunk_fwd_train`); ``h0`` and ``final`` are
    ``[N, HV, V, K]`` with ``state_v_first``, else ``[N, HV, K, V]``."""
    f = chunk_prepare_recompute(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, slots=slots, precision=precision, norms=norms
    )
    Hin, E = chunk_state(
        W=f.W, U=f.U, Kend=f.Kend, Gl=f.Gl, h0=h0, cu=cu, precision=precision, final=final, offsets=offsets,
        state_v_first=state_v_first,
    )  # fmt: skip
    return Recomputed(f.Mqk, f.Qt, f.Kend, f.Gl, f.Tm, f.W, Hin, E)


@triton.jit
def clear_empty_slots_kernel(Gl, Hin, slot_count, K, KV, BLOCK: tl.constexpr):
    """Zeros into ``Gl [NC, HV, K]`` and ``Hin [NC, HV, K, V]`` at the slots no chunk uses (``count == 0``), which
    the stages never write."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    if tl.load(slot_count + i_c) != 0:
        return
    base = i_c.to(tl.int64) * tl.num_programs(1) + i_hv
    o = tl.arange(0, BLOCK)
    for s in range(0, K, BLOCK):
        tl.store(Gl + base * K + s + o, tl.zeros([BLOCK], dtype=Gl.dtype.element_ty), mask=s + o < K)
    for s in range(0, KV, BLOCK):
        tl.store(Hin + base * KV + s + o, tl.zeros([BLOCK], dtype=Hin.dtype.element_ty), mask=s + o < KV)


def clear_empty_slots(fw: Recomputed, slots: SlotRows) -> None:
    """Make the factors of unused chunk slots zeros: ``kda::chunk_train`` returns them, and an op's outputs are
    determined by its inputs (``torch.library.opcheck`` compares two calls). One launch of ``NC x HV`` programs,
    nearly all of which return at once."""
    NC, HV, K = fw.Gl.shape
    KV = fw.Hin.shape[2] * fw.Hin.shape[3]
    _launch_clear((NC, HV), (fw.Gl, fw.Hin, slots.count, K, KV), {"BLOCK": 1024, "num_warps": 4})


_launch_clear = Launcher(clear_empty_slots_kernel)


def recomputed_empty(q: Tensor, v: Tensor, N: int) -> Recomputed:
    """Uninitialised factors with the shapes and dtypes :func:`chunk_bwd_recompute` gives for ``q [B, T, H, K]``,
    ``v [B, T, HV, V]`` and ``N`` sequences: the fake function of ``kda::chunk_train``'s saved outputs (its tests
    check the two agree)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BTt = B * T
    NC = num_chunk_slots(BTt, N, BT)
    full = state_dtype(v)
    store = recompute_precision(v.dtype).store or full
    states = store

    def new(*shape: int, dtype: torch.dtype) -> Tensor:
        return v.new_empty(shape, dtype=dtype)

    return Recomputed(
        Mqk=new(BTt, HV, BT, dtype=full), Qt=new(BTt, HV, K, dtype=store), Kend=new(BTt, HV, K, dtype=store),
        Gl=new(NC, HV, K, dtype=full), Tm=new(BTt, HV, BT, dtype=full), W=new(BTt, HV, K, dtype=store),
        Hin=new(NC, HV, K, V, dtype=states), E=new(BTt, HV, V, dtype=states),
    )  # fmt: skip


__all__ = ["Recomputed", "chunk_bwd_recompute", "clear_empty_slots", "recompute_precision", "recomputed_empty"]
