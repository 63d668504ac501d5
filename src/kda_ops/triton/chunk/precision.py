"""Per-product precision of the chunk pipeline.

Every matrix product of the pipeline goes through :func:`~kda_ops.triton.lang.mm` with a compile-time precision
string: ``"bf16"`` (operands rounded to bf16, fp32 accumulation: tensor cores at full rate), ``"tf32"`` (fp32
operands cut to TF32 by the tensor cores), ``"tf32rn"`` (rounded to nearest TF32 first), ``"tf32x3"`` or ``"ieee"``
(``"ieee"`` is exact fp32). :class:`Precision` names one per product and
the storage dtype of the per-chunk factors; :func:`precision_for` gives the default for an input dtype, and
:func:`use_precision` overrides it (the benchmark measures the alternatives with it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from kda_ops.triton.launch import interpreting

PRECISIONS = ("bf16", "tf32", "tf32rn", "tf32x3", "ieee")


def exact_bf16(prec: str, *operands: Tensor) -> str:
    """The precision of a product whose operands are read from ``operands``: ``"bf16"`` when all are stored in bf16,
    so that bf16 holds them exactly and the product equals its TF32 or fp32 form (the same exact products, fp32
    accumulation) at the bf16 tensor-core rate and half the operand bytes; else ``prec``. Under the interpreter
    ``prec`` (its bf16 ``tl.dot`` is wrong, triton-lang/triton#11584)."""
    if not interpreting() and all(x.dtype == torch.bfloat16 for x in operands):
        return "bf16"
    return prec


@dataclass(frozen=True)
class Precision:
    """Per-product precision of the chunk pipeline (each one of :data:`PRECISIONS`) and the storage dtype.

    intra:  the chunk's Mqk and Mkk (products of decayed keys and queries)
    solve:  the doubling steps of ``(I + Mkk)^-1`` (its 16x16 diagonal blocks and the chunk-wide steps)
    wy:     ``W = Tm diag(beta) Kt`` and ``U = Tm diag(beta) V``
    scan:   ``W S`` and ``Kend^T E`` in the state scan (the sequential critical path)
    output: ``Qt S`` and ``Mqk E``
    store:  dtype of the stored per-chunk factors W, U, Qt, Kend, Mqk (None: the compute dtype)
    """

    intra: str = "ieee"
    solve: str = "ieee"
    wy: str = "ieee"
    scan: str = "ieee"
    output: str = "ieee"
    store: torch.dtype | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "store" and value not in PRECISIONS:
                raise ValueError(f"Precision.{f.name}: expected one of {PRECISIONS}, got {value!r}")


# Defaults per input dtype. fp32 inputs promise <= 1e-4 relative error: exact fp32 products in the chunk-local
# stages; 3xTF32 (~2e-7 per product) in the scan and the output, whose exact-fp32 form compiles for sm_90 to a
# CUDA-core product that spills (ptxas, K = V = 128). 16-bit inputs: factors stored in the input's dtype (half the
# bytes of the stages' traffic). bf16: bf16 products in the scan and the output (tensor cores at full rate, no fp32
# operand tiles): the scan at B1 T32768 H32 on an H200 0.983 ms, 1.581 in exact fp32, with the same error; TF32 in
# the intra products, the solve and W, U, where bf16 saves no time in the intra products, raises the error in W, U,
# and in the solve would round an inverse that grows in ill-conditioned chunks. fp16: fp16 factors hold 11
# significant bits to bf16's 8 (the forward's error at B1 T63 K = V = 64 under the interpreter 3.0e-4, 5.4e-3 with
# bf16 factors), and every product takes TF32, which holds them exactly and keeps the state's range (a bf16 product
# would round them, an fp16 one could overflow the state), its fp32 operands rounded to nearest: cut toward zero
# they left o at that shape at 1.25e-3 on an H200, 4.3e-4 rounded, 3.7e-4 with Mqk and Mkk (whose decayed operands
# carry the most of the rest) in 3xTF32, for 8 % more time at B1 T32768 H32. The alternatives for bf16 are rows of
# `python benchmarks/bench_chunk.py --precision-sweep`.
_DEFAULTS: dict[torch.dtype, Precision] = {
    torch.float64: Precision(),
    torch.float32: Precision(scan="tf32x3", output="tf32x3"),
    torch.float16: Precision("tf32x3", "tf32rn", "tf32rn", "tf32rn", "tf32rn", torch.float16),
    torch.bfloat16: Precision("tf32", "tf32", "tf32", "bf16", "bf16", torch.bfloat16),
}


_override: dict[torch.dtype, Precision] = {}


@contextlib.contextmanager
def use_precision(dtype: torch.dtype, precision: Precision) -> Iterator[None]:
    """Run chunk kernels on ``dtype`` inputs with ``precision`` instead of the default (benchmarks, studies)."""
    old = _override.get(dtype)
    _override[dtype] = precision
    try:
        yield
    finally:
        if old is None:
            _override.pop(dtype, None)
        else:
            _override[dtype] = old


def precision_for(dtype: torch.dtype) -> Precision:
    """The precision used for inputs of ``dtype``: fp64 is exact everywhere; the interpreter upcasts bf16 products
    (its bf16 ``tl.dot`` is wrong, triton-lang/triton#11584) while keeping the bf16 storage."""
    p = _override.get(dtype, _DEFAULTS[dtype])
    if dtype == torch.float64:
        return Precision(store=torch.float64)
    if interpreting():
        upcast: dict[str, Any] = {f.name: "ieee" for f in fields(p) if getattr(p, f.name) == "bf16"}
        p = replace(p, **upcast)
    return p if p.store is not None else replace(p, store=torch.float32)
