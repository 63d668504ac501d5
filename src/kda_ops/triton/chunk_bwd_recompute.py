"""Backward stage 1: recompute the forward's per-chunk factors from the (prepared) inputs.

The forward op saves only its inputs (``docs/architecture.md``, "Chunk backward: what is saved"); the backward
reruns the forward's stage kernels, keeping what the gradient stages read::

    Mqk, Mkk, Qt, Kend, Gam_last      (chunk_intra)
    Tm, W, U                          (chunk_solve)
    Hin, E                            (chunk_state with store_states: the state entering each chunk, the errors)

The inputs are prepared in torch (:mod:`~kda_ops.triton.chunk_bwd_gates`), so the stages run without in-kernel
options. Everything is stored in the compute dtype (fp32): the gradients chain several products of these factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kda_ops.common import Options
from kda_ops.triton.chunk_common import Precision
from kda_ops.triton.chunk_intra import chunk_intra
from kda_ops.triton.chunk_solve import chunk_solve
from kda_ops.triton.chunk_state import chunk_state
from kda_ops.varlen import SlotRows

_NO_OPTIONS = Options()


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


def recompute_precision(dtype: torch.dtype) -> Precision:
    """The forward stages' precision in the backward: fp32 storage always; 16-bit inputs take tf32 products and the
    solve's merges in 3xTF32, as in the forward (the forward's defaults would store bf16 factors, which the
    gradients compound). Exact fp32 merges (``"ieee"``) compile for sm_90 to CUDA-core products that spilled 816 bytes
    per thread (ptxas, K = V = 128); 3xTF32 spills none."""
    if dtype == torch.float64:
        return Precision(store=torch.float64)
    if dtype == torch.float32:
        return Precision(scan="tf32x3", output="tf32x3", store=torch.float32)
    return Precision("tf32", "tf32x3", "tf32", "tf32", "tf32", torch.float32)


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
) -> Recomputed:
    """Prepared ``q, k [T, H, K]``, ``v [T, HV, V]``, log decay ``g [T, HV, K]``, ``beta [T, HV]``; ``h0`` in the
    compute dtype or None; ``cu`` the sanitized flat ``cu_seqlens`` and ``slots`` its chunk map."""
    Mqk, Mkk, Qt, Kend, Gl = chunk_intra(q, k, g, beta, scale, slots, None, None, _NO_OPTIONS, precision)
    Tm, W, U = chunk_solve(Mkk, k, v, g, beta, slots, None, None, _NO_OPTIONS, precision)
    Hin, E = chunk_state(W, U, Kend, Gl, h0, cu, precision, store_states=True, offsets=offsets)
    assert Hin is not None and E is not None
    return Recomputed(Mqk, Qt, Kend, Gl, Tm, W, Hin, E)


__all__ = ["Recomputed", "chunk_bwd_recompute", "recompute_precision"]
