"""Warm-up before a CUDA-graph capture: compile the Triton kernels a call can use.

Triton compiles a kernel on its first call for each set of compile-time arguments, which cannot happen inside
``torch.cuda.graph(...)``. Those arguments are what a model fixes once: the head dimensions ``K`` and ``V``, the
dtypes, the in-kernel options and the per-product precision, plus the value tile of the chunk scan, which depends
on ``N * HV`` (the number of sequences and value heads, for parallelism), and the form of the output stage, which
depends on the number of chunk slots (a program per item for short inputs). Launch configurations are fixed (no
autotuning). Neither ``B``, ``T`` nor the values of ``cu_seqlens`` play a part otherwise. So one :func:`warmup`
call with small example inputs of the real head counts, dtypes and options, which compiles every value tile the
scan may pick and both forms of the output stage, leaves nothing to compile for any batch, length or packing::

    kda_ops.warmup(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], use_qk_l2norm_in_kernel=True,
                   initial_state=h0, output_final_state=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, state = kda_ops.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, initial_state=h0,
                                     output_final_state=True, cu_seqlens=cu_seqlens)

The recurrent kernels use fixed launch configurations; :func:`warmup` compiles them for the example's length and
for one-token decode steps (a length of 1 is a constant to Triton). Other lengths that are neither 1 nor a
multiple of 16 (a 3-token speculative step, say), and a serving pool of one slot, are compiled forms of their own:
make one eager call of such a step before capturing it (``docs/serving.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kda_ops import ops
from kda_ops.api import chunk_kda, recurrent_kda


def warmup(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, **kwargs: Any) -> None:
    """Compile every Triton kernel that ``chunk_kda(q, k, v, g, beta, **kwargs)`` and
    ``recurrent_kda(...)`` use, for every value tile the chunk scan may pick, then wait for the device.

    Pass example inputs with the real ``H``, ``HV``, ``K``, ``V``, dtypes and keyword options (``initial_state``
    and ``output_final_state`` included: each combination is its own compiled kernel); small ``B`` and ``T``
    suffice. Afterwards calls with any ``B``, ``T`` and ``cu_seqlens`` values run without autotuning, so they can
    be captured in a CUDA graph. A no-op on the CPU. Not for use inside a capture or a compiled region.
    """
    if q.device.type != "cuda":
        return
    if ops.uses_triton("chunk", q.device):
        from kda_ops.triton import chunk_output, chunk_state  # imported lazily: triton is needed on this path only

        V = v.shape[-1]
        old_bv, old_few = chunk_state.BV_OVERRIDE, chunk_output.FEW_ITEMS_PER_SM
        try:
            for bv in chunk_state.block_v_choices(V):
                chunk_state.BV_OVERRIDE = bv
                chunk_kda(q, k, v, g, beta, **kwargs)
            chunk_state.BV_OVERRIDE = old_bv
            for few in (0, 1 << 30):  # the output stage's programs walking the items, then a program per item
                chunk_output.FEW_ITEMS_PER_SM = few
                chunk_kda(q, k, v, g, beta, **kwargs)
        finally:
            chunk_state.BV_OVERRIDE, chunk_output.FEW_ITEMS_PER_SM = old_bv, old_few
    else:  # the reference kernel (the loops above ran every form a default Triton call takes)
        chunk_kda(q, k, v, g, beta, **kwargs)
    recurrent_kda(q, k, v, g, beta, **kwargs)
    if kwargs.get("cu_seqlens") is None and q.shape[1] > 1:
        # a decode step (one token per sequence): Triton compiles the recurrent kernel apart for a length of 1
        recurrent_kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], **kwargs)
    torch.cuda.synchronize(q.device)  # sync-ok: warmup runs before capture, by contract


__all__ = ["warmup"]
