"""Shared pieces of the chunk kernels: chunk geometry, per-product precision, register-block loads and stores.

Geometry. A chunk is ``BT = 64`` consecutive tokens of one sequence; its tiles are loaded as ``[BT, BK]`` register
blocks. Where the math works per 16-row block (the block path of ``chunk_intra``, the solve of ``chunk_solve``) a
tile is reshaped to ``x3 [NB, BC, BK]`` (``NB = 4`` blocks of ``BC = 16`` rows): row ``I * BC + r`` of the chunk
at ``x3[I, r]``.

Precision. Every matrix product of the pipeline goes through :func:`mm` with a compile-time precision string:
``"bf16"`` (operands rounded to bf16, fp32 accumulation: tensor cores at full rate), ``"tf32"``, ``"tf32x3"`` or
``"ieee"`` (fp32 operands; ``"ieee"`` is exact fp32). :class:`Precision` names one per product and the storage
dtype of the per-chunk factors; :func:`precision_for` gives the default for an input dtype, and
:func:`use_precision` overrides it (the benchmark measures the alternatives with it).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BT = 64  # tokens per chunk
BC = 16  # tokens per row block: the unit of the overflow-free decays and of the solve
NB = BT // BC

# Largest span of the cumulative log decay (in nats) that a factored product may carry in one factor. A factor is
# then at most exp(80) ~ 5.5e34: no fp32/bf16/tf32 overflow for inputs up to |x| ~ 6e3, no underflow below fp32's
# normal range on the other side. The products of masked (future) entries may overflow; they are dropped by
# `tl.where`, never multiplied by a mask.
# ANCHOR_SPAN: the whole chunk factored around its middle row, when every half chunk spans <= 80 nats (gates up to
# ~2.5 nats per token): one tensor-core product per key tile. FACTOR_SPAN: within one 16-row block of the block path
# (gates up to 5 nats per token); blocks beyond it are formed pairwise, exactly.
ANCHOR_SPAN = 80.0
FACTOR_SPAN = 80.0

PRECISIONS = ("bf16", "tf32", "tf32x3", "ieee")

# Launch configuration of each stage kernel: fixed, chosen by measurement on the H200 (``python
# benchmarks/bench_chunk.py --sweep-launch``), so that no call autotunes and a capture needs no warm-up beyond the
# compile. ``BK``/``BV``: the key/value tile where the stage loops over tiles. Benchmarks override entries.
LAUNCH: dict[str, dict[str, int]] = {
    "cumsum": {"num_warps": 4, "num_stages": 1},
    # chunk_anchor_sums at B1 T32768 H32 on the H200 (2026-11-30): BK 64 with 2 warps 0.140 ms, 4 warps 0.189;
    # BK 128 with 2 / 4 / 8 warps 0.141 / 0.165 / 0.476; BK 32 with 2 / 4 warps 0.146 / 0.194
    "sums": {"num_warps": 2, "num_stages": 1},
    "intra": {"num_warps": 4, "num_stages": 1, "BK": 32},
    "solve": {"num_warps": 4, "num_stages": 1, "BK": 64, "BV": 64},
    # stages 1-3 fused (chunk_prepare): the anchored pass, and the block pass of the flagged chunks
    "prepare": {"num_warps": 4, "num_stages": 1, "BK": 32, "BV": 64},
    "prepare_blocks": {"num_warps": 8, "num_stages": 1, "BK": 16, "BV": 64},
    "scan": {"num_warps": 8, "num_stages": 1},
    # output: BV 128 with 16-bit states and K <= 128 (a program per item: 122 registers, 72 KB shared at K = 128);
    # chunk_output caps it at 64 elsewhere. B1 T32768 H32 bf16 on the H200 (2026-11-30, a program per item): BV 128 /
    # 4 warps 0.436 ms, BV 64 / 4 warps 0.460, BV 64 / 8 warps 0.510, BV 128 / 8 warps 0.500, BV 32 / 4 warps 0.836.
    # Where the tiles are 16-bit and K <= 128, a program per SM walks the (chunk slot, value tile, value head) items
    # with its loop pipelined over 3 stages (152 registers, 156 KB of shared memory), against a program per item
    # (three per SM), which leaves each program's loads exposed (chunk_output). B1 T32768 H32 bf16 on the H200
    # (triton 3.6, 2026-11-30, `.scratch/outexp.py`, same outputs bit for bit): a program per item 0.420 ms (0.409
    # with E loaded as stored, not through fp32), per SM with 2 / 3 / 4 stages 0.422 / 0.385 / 0.386; programs of
    # 8 / 16 / 32 consecutive slots, 3 stages, 0.392 / 0.389 / 0.410; 2 programs per SM, 3 stages, at BV 64 0.434,
    # with 8 warps 0.438.
    "output": {"num_warps": 4, "num_stages": 3, "BV": 128},
    # The backward's per-chunk gradient stages (chunk_bwd_dv; chunk_bwd_dqk: its anchored pass, its block pass).
    # Forward + backward at B1 T32768 H32 bf16 on the H200 (2026-11-29): dqk 8 warps BV 32 27.78 ms, BV 64 26.37;
    # dv 4 warps BV 32 27.78, 8 warps 29.42, 8 warps BV 64 28.49. Spills (ptxas sm_90, bytes per thread): dqk
    # 8 warps BV 64 16, BV 32 96, 4 warps 560-608, BK 64 456-1992; dv 4 warps BV 32 32, BK or BV 64 with 4 warps
    # 256-560. The block pass (flagged chunks only) spills 168 B with 4 warps. Again on 2026-11-30 (fwd + bwd 18.84
    # ms, dv 3.01): dv with 8 warps at BK 64 / BV 64, BK 64 / BV 32, BK 32 / BV 64 (no spills) 19.24 / 19.82 / 19.78.
    "dv": {"num_warps": 4, "num_stages": 1, "BK": 32, "BV": 32},
    "dqk": {"num_warps": 8, "num_stages": 1, "BK": 32, "BV": 64},
    "dqk_blocks": {"num_warps": 4, "num_stages": 1, "BK": 32, "BV": 32},
}


def launch(stage: str, **tiles: int) -> dict[str, int]:
    """The ``num_warps``/``num_stages`` of ``stage``'s kernel, and each tile of ``tiles`` (``name=dim``) as the
    configured tile capped at ``pow2(dim)``: keyword arguments for the launch."""
    cfg = LAUNCH[stage]
    out = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    for name, dim in tiles.items():
        out[name] = min(pow2(dim), cfg[name])
    return out


def exact_bf16(prec: str, *operands: Tensor) -> str:
    """The precision of a product whose operands are read from ``operands``: ``"bf16"`` when all are stored in bf16,
    so that bf16 holds them exactly and the product equals its TF32 or fp32 form (the same exact products, fp32
    accumulation) at the bf16 tensor-core rate and half the operand bytes; else ``prec``. Under the interpreter
    ``prec`` (its bf16 ``tl.dot`` is wrong, triton-lang/triton#11584)."""
    if not interpreting() and all(x.dtype == torch.bfloat16 for x in operands):
        return "bf16"
    return prec


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compute_dtype(x: Tensor) -> Any:
    """Triton compute type: fp64 for fp64 inputs (exact checks), fp32 otherwise."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def contiguous(x: Tensor) -> Tensor:
    return x if x.is_contiguous() else x.contiguous()


def pow2(n: int, lo: int = 16) -> int:
    """``next_power_of_2(n)``, at least ``lo`` (``tl.dot`` needs every dimension >= 16). Plain Python, as is
    :func:`cdiv`: Triton's own helpers are constexpr functions that cost microseconds a call from host code, about
    a dozen of them per forward call."""
    return max(lo, 1 << (n - 1).bit_length()) if n > 0 else lo


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code (see :func:`pow2`)."""
    return -(-a // b)


# The forward's kernels are compiled once for every batch length and packing: Triton specialises each integer
# argument on its divisibility by 16 and each pointer on its 16-byte alignment, so the lengths (``T``, the chunk
# slots ``NC``, ...) and the chunk map's views (``slot_count`` sits ``8 * NC`` bytes into the map's buffer, the
# l2norm factors of k ``4 * HV * T`` bytes into theirs) would each make a variant, and a call after
# ``kda_ops.warmup`` on short inputs could compile inside a CUDA-graph capture. Neither is read in a way that
# vectorizes (scalar slot bounds, one factor per row).
jit_any_length = triton.jit(
    do_not_specialize=["B", "T", "NC", "nch", "NI"],
    do_not_specialize_on_alignment=["slot_start", "slot_count", "cu", "chunk_off", "Nk", "Nq", "Nrm", "Rqk"],
)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """The first statement of a kernel launched with :func:`pdl`: wait for the kernel before it on the stream to
    complete (its writes visible), then let the next one launch. Nothing is read or written before the wait."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl(device: torch.device) -> Mapping[str, bool]:
    """Launch options of the kernels that open with :func:`pdl_enter`: programmatic dependent launch where the GPU
    has it (sm_90 and later, compiled rather than interpreted), so that a kernel's programs are launched, and wait,
    while the kernel before them finishes, instead of after it (the launch latency off the stream's critical path).
    Measured on the H200 (triton 3.6, 2026-11-30, `.scratch/pv.py`, fresh processes alternating): the forward at
    B1 T1024 H32 bf16 under a CUDA graph 117.3 / 117.1 -> 114.3 / 114.3 µs, at T = 8192 750 -> 749 µs.
    """
    return _pdl(_index(device)) if device.type == "cuda" else _NO_PDL


_NO_PDL: Mapping[str, bool] = MappingProxyType({"PDL": False})


@functools.cache
def _pdl(index: int) -> Mapping[str, bool]:
    # CUDA 12.4 and later: the launches are captured into CUDA graphs as programmatic edges (kept off before)
    on = not interpreting() and cuda_version(torch.version.cuda) >= (12, 4)
    on = on and torch.cuda.get_device_capability(index)[0] >= 9
    return MappingProxyType({"PDL": True, "launch_pdl": True}) if on else _NO_PDL


def cuda_version(text: str | None) -> tuple[int, ...]:
    """``"12.4"`` as ``(12, 4)``; ``()`` for a build without CUDA (``torch.version.cuda`` is None) or an odd string."""
    try:
        return tuple(int(part) for part in (text or "").split(".")[:2])
    except ValueError:
        return ()


def _index(device: torch.device) -> int:
    """The index of CUDA ``device``, else of the current device."""
    return torch.cuda.current_device() if device.index is None else device.index


def num_sms(device: torch.device) -> int:
    """The SM count of CUDA ``device`` (its index, else the current device), 1 off CUDA; cached per device index, so
    that a launch pays a dict lookup."""
    if device.type != "cuda":
        return 1
    return _sm_count(_index(device))


def persistent_programs(device: torch.device) -> int:
    """Programs of a kernel whose programs walk its items in turn: one per SM on CUDA; 4 off CUDA, so that the
    interpreter's tests take a program over several items."""
    return num_sms(device) if device.type == "cuda" else 4


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


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


# Defaults per input dtype. fp32 inputs promise <= 1e-4 relative error: exact fp32 products in the chunk-local stages;
# 3xTF32 (~2e-7 per product) in the scan and the output, whose exact-fp32 form compiles for sm_90 to a CUDA-core
# product that spills 8 KB per thread (ptxas, K = V = 128). 16-bit inputs: factors stored in bf16 (half the bytes of
# the stages' traffic); bf16 products in the scan and the output (tensor cores at full rate, no fp32 operand tiles);
# TF32 in the intra products, the solve and W, U (the solve's 16-row diagonal blocks ran in 3xTF32 until measured:
# 0.13 ms of the forward, no change in any error, chunk_solve.solve_unit_lower). Measured on the H200 (triton 3.6,
# 2026-11-29; error at B1 T1000 H32 vs the float64 oracle, stage ms at B1 T32768 H32; the alternatives are rows of
# `python benchmarks/bench_chunk.py --precision-sweep`):
# all-TF32 products o 2.79e-3, scan 1.581 ms, output 0.849 ms; bf16 scan o 2.79e-3, scan 0.983 ms; bf16 output
# (value tile 64) o 3.11e-3, output 0.669 ms. The doubling solve (staged kernel): 3xTF32 steps 5.14 ms (1.4 KB of
# spills per thread), TF32 1.42 ms, bf16 1.06 ms, each o 3.11e-3 / state 2.37e-3; the row-by-row solve it replaced
# took 2.32 ms. Inside the fused prepare kernel a bf16 solve saved 0.08 ms of 4.45. Not taken: bf16 intra products
# (o 3.43e-3, no time saved; 3.76e-3 fused), bf16 W, U (o 3.13e-3, state 2.89e-3), a bf16 solve (the error of
# ill-conditioned chunks, where the inverse grows, is not measured on the GPU). fla-core: o 4.10e-3.
_DEFAULTS: dict[torch.dtype, Precision] = {
    torch.float64: Precision(),
    torch.float32: Precision(scan="tf32x3", output="tf32x3"),
    torch.float16: Precision("tf32", "tf32", "tf32", "bf16", "bf16", torch.bfloat16),
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


# ------------------------------------------------------------------------------------------- jit helpers


@triton.jit
def mm(a, b, PREC: tl.constexpr, DT: tl.constexpr):
    """``a @ b`` (2-D, or 3-D batched) accumulated in ``DT``, operands at precision ``PREC``."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16)).to(DT)
    else:
        return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def scale_rows(x, n, ON: tl.constexpr):
    """``diag(n) x`` for ``x [BT, *]`` and ``n [BT]`` when ``ON``, else ``x`` (``n`` then unused, e.g. 1.0)."""
    if ON:
        return x * n[:, None]
    else:
        return x


@triton.jit
def row_factors(N, tok, m, col, stride, DT: tl.constexpr, ON: tl.constexpr):
    """Per-row factors ``N[tok, col]`` of a row-major ``[T, stride]`` table (l2norm factors), ``[BT]`` in ``DT``,
    when ``ON``; else the constant 1.0 (for :func:`scale_rows`). 0 for rows outside ``m``."""
    if ON:
        return tl.load(N + tok * stride + col, mask=m, other=0.0).to(DT)
    else:
        return 1.0


@triton.jit
def head_factors(N, tok, m, i_hv, T, DT: tl.constexpr, ON: tl.constexpr):
    """:func:`row_factors` of value head ``i_hv`` from a ``[HV, T]`` table, each head's rows contiguous: the l2norm
    factors the prepare kernel stores (``chunk_prepare.store_norms``) and the scan and the output stage load."""
    return row_factors(N, tok, m, i_hv.to(tl.int64) * T, 1, DT, ON)


@triton.jit
def col_mask(o_k, K: tl.constexpr, BK: tl.constexpr):
    """``o_k < K``; a constant ``True`` when ``BK`` divides ``K``, so that the compiler sees the columns unmasked and
    vectorizes the loads (a per-element mask costs a 64-bit pointer per element: 255 registers and spills in the
    scan at K = 128, measured with ptxas for sm_90)."""
    if K % BK == 0:
        return tl.full((BK,), 1, tl.int1)
    else:
        return o_k < K


@triton.jit
def load2(ptr, tok, m, stride, o_k, m_k, DT: tl.constexpr):
    """``x[tok, o_k]`` as ``[BT, BK]`` in ``DT`` (0 outside the masks)."""
    p = ptr + tok[:, None] * stride + o_k[None, :]
    return tl.load(p, mask=m[:, None] & m_k[None, :], other=0.0).to(DT)


@triton.jit
def load2n(ptr, Nx, tok, m, stride, o_k, m_k, i_h, H, DT: tl.constexpr, NORMS: tl.constexpr):
    """:func:`load2` of q or k rows (``ptr`` at the head), times their l2norm factors ``Nx[tok, i_h]`` (``[T, H]``)
    when ``NORMS``: ``x r`` in ``DT``, the product the l2norm pass would have stored."""
    return scale_rows(load2(ptr, tok, m, stride, o_k, m_k, DT), row_factors(Nx, tok, m, i_h, H, DT, NORMS), NORMS)


@triton.jit
def tile2(ptr, tok, m, stride, o_k, m_k):
    """``x[tok, o_k]`` as ``[BT, BK]`` in its stored dtype (0 outside the masks): a product operand as loaded."""
    return tl.load(ptr + tok[:, None] * stride + o_k[None, :], mask=m[:, None] & m_k[None, :], other=0.0)


@triton.jit
def store2(ptr, tok, m, stride, o_k, m_k, x):
    p = ptr + tok[:, None] * stride + o_k[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=m[:, None] & m_k[None, :])


@triton.jit
def rnorm2(ptr, tok, m, stride, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr):
    """``1 / sqrt(sum_d x[tok, d]^2 + 1e-6)`` per row, ``[BT, 1]``: the l2norm factor over the whole key dim."""
    ss = tl.zeros((BT,), dtype=DT)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        x = load2(ptr, tok, m, stride, o_k, col_mask(o_k, K, BK), DT)
        ss += tl.sum(x * x, axis=1)
    return rnorm(ss)[:, None]


@triton.jit
def rnorm(ss):
    """The l2norm factor ``1 / sqrt(ss + 1e-6)`` of rows whose sums of squares are ``ss`` (``reference/gates.py``)."""
    return 1.0 / tl.sqrt(ss + 1e-6)


@triton.jit
def beta_value(x, USE_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """``sigmoid(x)`` when asked, times 2 with negative eigenvalues (``reference/gates.py``)."""
    if USE_SIGMOID:
        x = 1.0 / (1.0 + tl.exp(-x))
    if NEG_EIGVAL:
        x = x * 2.0
    return x


@triton.jit
def load_beta2(ptr, tok, m, HV, i_hv, USE_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, DT: tl.constexpr):
    """beta of the chunk's rows, ``[BT]``, 0 on padding rows."""
    x = tl.load(ptr + tok * HV + i_hv, mask=m, other=0.0).to(DT)
    return tl.where(m, beta_value(x, USE_SIGMOID, NEG_EIGVAL), 0.0)


@triton.jit
def slot_rows(slot_start, slot_count, i_c, BT: tl.constexpr):
    """Tokens of chunk slot ``i_c``: ``(count, tok [BT] int64, m)`` (``m``: the row holds a token)."""
    count = tl.load(slot_count + i_c).to(tl.int32)
    rows = tl.arange(0, BT)
    return count, tl.load(slot_start + i_c).to(tl.int64) + rows, rows < count


@triton.jit
def max2(x):
    """The largest element of a 2-D block (a scalar)."""
    return tl.max(tl.max(x, axis=1), axis=0)
