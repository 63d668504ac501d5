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

The recurrent kernel uses fixed launch configurations and compiles one form for every length and pool size, so
:func:`warmup` compiles, from the same example, ``recurrent_kda`` and the serving step ``recurrent_kda_update_``
(with int32 and int64 slot indices) for any number of tokens per sequence: one-token decode steps, speculative
steps of a few tokens, chunked prefill. ``cu_seqlens`` given or not is part of the form (packed or dense batch):
warm up with the form the captured calls use (``docs/serving.md``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from kda_ops import ops
from kda_ops.api import (
    check_call,
    check_float,
    chunk_kda,
    chunk_kda_update_,
    recurrent_kda,
    recurrent_kda_update_,
)
from kda_ops.common import num_sequences, state_dtype, state_shape

# keyword arguments of chunk_kda that recurrent_kda does not take, and those the serving step does not take either
_CHUNK_ONLY = ("recompute_in_backward", "return_intermediate_states")
_NOT_SERVING = ("initial_state", "output_final_state", *_CHUNK_ONLY)
# keyword arguments of the recurrent serving step that chunk_kda does not take (its speculative forms)
_SERVING_ONLY = ("num_accepted_tokens", "write_states")
# and those of the chunkwise prefill into the pool (its checkpoints: a form warmup compiles)
_PREFILL_ONLY = ("checkpoint_every", "checkpoint_indices")


def _without(kwargs: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {name: value for name, value in kwargs.items() if name not in names}


def warmup(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, **kwargs: Any) -> None:
    """Compile every Triton kernel that ``chunk_kda(q, k, v, g, beta, **kwargs)``, ``recurrent_kda(...)`` and the
    serving steps (``recurrent_kda_update_``, its speculative verify, ``chunk_kda_update_`` with and without
    checkpoints) on a float32 pool with the same options use, for every form the chunk scan may pick, then wait for
    the device (a bfloat16 pool's kernels compile at its first call: warm them up with a call of your own).

    Pass example inputs with the real ``H``, ``HV``, ``K``, ``V``, dtypes and keyword options (``initial_state``
    and ``output_final_state`` included: each combination is its own compiled kernel; ``state_v_first`` too, which
    the serving step's scratch pool follows); small ``B`` and ``T``
    suffice. Afterwards calls with any ``B``, ``T`` and ``cu_seqlens`` values run without autotuning, so they can
    be captured in a CUDA graph. On the CPU it only checks the arguments (their types, shapes, dtypes, devices and
    flags, as ``chunk_kda`` checks them). Not for use inside a capture or a compiled region.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float(name, x)  # before q.device is read: a clear error for a list, as the public functions give
    params = inspect.signature(chunk_kda).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:  # on every device, so that a misspelt option shows on a CPU machine too
        raise TypeError(f"warmup: unexpected keyword arguments {unknown} (chunk_kda's options are taken)")
    # the arguments as chunk_kda checks them, on every device too (shapes, dtypes, devices: no value of a device)
    a = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty} | kwargs
    named = inspect.signature(check_call).parameters  # the rest of chunk_kda's options are its bool flags
    check_call(q, k, v, g, beta, **{n: x for n, x in a.items() if n in named or isinstance(params[n].default, bool)})
    if q.device.type != "cuda":
        return
    # the serving steps from a scratch pool, one slot per sequence (their options without the state arguments)
    N = num_sequences(q, kwargs.get("cu_seqlens"))
    shape = state_shape(N, v.shape[2], q.shape[3], v.shape[3], kwargs.get("state_v_first", False))
    pool = torch.zeros(shape, device=q.device, dtype=state_dtype(v))
    options = _without(kwargs, _NOT_SERVING)

    def chunk_forms_of(fn: Any) -> None:
        if ops.uses_triton("chunk", q.device):
            from kda_ops.triton import chunk_forms, force_forms  # imported lazily: triton is needed here only

            for form in chunk_forms(v.shape[-1]):
                with force_forms(**form):
                    fn()
        else:  # the reference kernel
            fn()

    chunk_forms_of(lambda: chunk_kda(q, k, v, g, beta, **kwargs))
    recurrent_kda(q, k, v, g, beta, **_without(kwargs, _CHUNK_ONLY))
    with torch.no_grad():  # the serving steps are not differentiable
        for dtype in (torch.int32, torch.int64):
            slots = torch.arange(N, device=q.device, dtype=dtype)
            recurrent_kda_update_(q, k, v, g, beta, pool, slots, **options)
            recurrent_kda_update_(q, k, v, g, beta, pool, slots, **options, write_states=False)
            none = torch.full((N, 1), -1, device=q.device, dtype=dtype)  # the checkpoints' form, nothing written
            for ckpt in ({}, {"checkpoint_every": 64, "checkpoint_indices": none}):
                chunk_forms_of(lambda ckpt=ckpt, slots=slots: chunk_kda_update_(q, k, v, g, beta, pool, slots,
                                                                                 **options, **ckpt))  # fmt: skip
            # the speculative verify step (its form depends on no shape): a slot per token of every sequence
            if N and q.shape[1]:
                cu = kwargs.get("cu_seqlens")
                one = {} if cu is None else {"cu_seqlens": torch.tensor([0, 1], device=q.device, dtype=cu.dtype)}
                q1, k1, v1, g1, b1 = (t[:1, :1] for t in (q, k, v, g, beta))
                spec = torch.zeros(1, 1, device=q.device, dtype=dtype)
                for acc in (None, torch.ones(1, device=q.device, dtype=dtype)):
                    for write in (True, False):
                        recurrent_kda_update_(q1, k1, v1, g1, b1, pool[:1].clone(), spec, **{**options, **one},
                                              num_accepted_tokens=acc, write_states=write)  # fmt: skip
    torch.cuda.synchronize(q.device)  # sync-ok: warmup runs before capture, by contract


__all__ = ["warmup"]
