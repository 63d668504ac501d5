"""Launch configuration of every Triton kernel, and the pieces of host code that launch them.

- :data:`LAUNCH` and :func:`launch`: the fixed configuration of each chunk stage kernel (no autotuning: a call never
  tunes, and a CUDA-graph capture needs no warm-up beyond the compile); :func:`recurrent_config` and
  :func:`recurrent_bwd_config` size the recurrent kernels' tiles and warps from the head dimensions.
- :func:`pdl`: programmatic dependent launch where the GPU and the CUDA build have it.
- :func:`jit_any_length`: ``triton.jit`` without specialisation on lengths and map views (one form for every
  batch and packing).
- :class:`Launcher`: a cached launch for the kernels whose host cost per call matters (the eager decode step).
- :func:`poison_outputs`: the test hook that fills every output with NaN before its kernel runs.

:class:`Launcher`. ``kernel[grid](*args, **meta)`` binds every argument, computes Triton's specialization key (dtype
and 16-byte alignment of each pointer, ``== 1`` and divisibility by 16 of each integer, the constexprs), looks the
compiled kernel up and builds launch metadata for its (empty) hook chains, on every call. The launcher does the
lookup once per *launch key* and then calls the compiled kernel's launcher directly; its own key costs ~2.3 µs of
Python on a 2-core CPU. The launch key is a refinement of Triton's specialization key, so that a hit always finds
the kernel Triton itself would have picked: the caller's ``meta_key`` (which must determine ``meta``: the
constexprs and launch options), the device, and per runtime argument its class: a tensor's dtype and ``data_ptr()
% 16``, an integer's ``value % 16``, ``value == 1`` and whether it needs 64 bits, a float, or None. A miss launches
through Triton (compiling if needed) and keeps the compiled kernel. The cached path is taken only where it is exact:
on CUDA, outside the interpreter, with no launch hook installed (profilers install one; they then see every launch
through Triton's own path). That the cached path launches what Triton's own path launches is checked on the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.common import CHUNK_SIZE, triton_release


def _arg_key(args: Sequence[Any]) -> tuple[Any, ...] | None:
    """The launch key's part for the runtime arguments (see the module docstring), two entries per argument whatever
    its kind; None for an argument it does not classify (Triton's own path takes those launches)."""
    key: list[Any] = []
    for x in args:
        if type(x) is Tensor:
            key.append(x.dtype)
            key.append(x.data_ptr() & 15)
        elif x is None or type(x) is float:
            key.append(x is None)
            key.append(None)
        elif type(x) is int and -(2**63) <= x < 2**63:
            key.append((x & 15) + (0 if -(2**31) <= x < 2**31 else 16))
            key.append(x == 1)
        else:
            return None
    return tuple(key)


def _hooked() -> bool:
    """Whether a launch hook is installed. Triton 3.6 keeps its hooks as chains (never None) that are empty unless
    a profiler adds a call; Triton's own path then still builds the launch metadata and calls the empty chains."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(runtime, name, None)
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class Launcher:
    """Launch one ``@triton.jit`` kernel with a per-key cache of its compiled form (see the module docstring).

    ``args`` are the runtime (non-constexpr) arguments in the kernel's order; ``meta`` holds every constexpr and the
    launch options (``num_warps``, ...); ``meta_key`` must determine ``meta`` (default: its items).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._cache: dict[Hashable, tuple[Any, tuple[Any, ...] | None]] = {}

    def __call__(
        self, grid: tuple[int, ...], args: Sequence[Any], meta: dict[str, Any], meta_key: Hashable = None
    ) -> None:
        first = args[0]
        device = first.device if type(first) is Tensor else _CPU
        arg_key = None if device.type != "cuda" or _INTERPRETING or _hooked() else _arg_key(args)
        if arg_key is None:
            self.kernel[grid](*args, **meta)
            return
        key = (tuple(meta.items()) if meta_key is None else meta_key, device.index, arg_key)
        hit = self._cache.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **meta)
            self._cache[key] = (compiled, self._constexpr_tail(meta) if compiled is not None else None)
            return
        compiled, tail = hit
        if tail is None:  # no compiled kernel to call directly: Triton's own path every time
            self.kernel[grid](*args, **meta)
            return
        g = (*grid, 1, 1)
        compiled.run(g[0], g[1], g[2], _raw_stream(device.index), compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *tail)  # fmt: skip

    def _constexpr_tail(self, meta: dict[str, Any]) -> tuple[Any, ...] | None:
        """The constexpr values that follow the runtime arguments in the kernel's parameter list (Triton's launcher
        takes every parameter in order). None, and Triton's own path for every launch, unless the kernel declares
        all its runtime parameters first and ``meta`` holds every constexpr."""
        params = self.kernel.params
        n = sum(1 for p in params if not p.is_constexpr)
        if any(p.is_constexpr for p in params[:n]) or any(p.name not in meta for p in params[n:]):
            return None
        return tuple(meta[p.name] for p in params[n:])


def _raw_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as a raw handle (what Triton's own launch passes)."""
    return int(_get_raw_stream(index))


_get_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream
)


# Launch configuration of each chunk stage kernel: fixed, chosen by measurement on the H200 (the sweeps are in
# ``docs/experiments.md``), so that no call autotunes and a capture needs no warm-up beyond the compile. ``BK``/``BV``:
# the key/value tile where the stage loops over tiles.
LAUNCH: dict[str, dict[str, int]] = {
    # the anchor sums: BK 64 with 2 warps, 26 % less time than with 4 at B1 T32768 H32
    "sums": {"num_warps": 2, "num_stages": 1},
    # stages 1-3 fused: the anchored pass, and the block pass of the flagged chunks
    "prepare": {"num_warps": 4, "num_stages": 1, "BK": 32, "BV": 64},
    "prepare_blocks": {"num_warps": 8, "num_stages": 1, "BK": 16, "BV": 64},
    "scan": {"num_warps": 8, "num_stages": 1},
    # the reverse scan's off-chain term P = Mqk^T dO, a program per (chunk slot, value head)
    "scan_pre": {"num_warps": 4, "num_stages": 1, "BV": 64},
    # the split scan's passes: 4 warps let two programs share an SM (B1 T32768 H8 bf16: 0.991 ms at 8 segments,
    # against 1.168 with 8 warps)
    "scan_split": {"num_warps": 4, "num_stages": 1},
    "segments": {"num_warps": 8, "num_stages": 1, "BV": 16},
    # output: BV 128 with 16-bit states and K <= 128 (the output stage caps it at 64 elsewhere). There a program per
    # SM walks the (chunk slot, value tile, value head) items with its loop pipelined over 3 stages (152 registers,
    # 156 KB of shared memory): 8 % less time than a program per item at B1 T32768 H32 bf16.
    "output": {"num_warps": 4, "num_stages": 3, "BV": 128},
    # The backward's per-chunk gradient stages (dv; dqk: its anchored pass, its block pass), the largest tiles that
    # do not spill (ptxas, sm_90): dqk at BV 64 gains 1.4 ms of the B1 T32768 H32 bf16 forward + backward over BV 32;
    # dv at BK 64 reads dE's tiles twice per chunk instead of four times: 2.92 -> 2.54 ms over BK 32 (same shape, H100).
    "dv": {"num_warps": 4, "num_stages": 1, "BK": 64, "BV": 32},
    # PREFETCH=1: the next key tile's q, k and Gam loaded before this tile's stores, 5.5 % off the B1 T32768 H32 bf16
    # forward + backward (13.78 -> 13.02 ms, H100; the fp16 form 5.8 %), the gradients bit for bit the same
    "dqk": {"num_warps": 8, "num_stages": 1, "BK": 32, "BV": 64, "PREFETCH": 1},
    # the dq/dk stage with 2xTF32 products (fp16 inputs): 152 B of spills per thread at BK 16, 360 at BK 32
    "dqk_split": {"num_warps": 8, "num_stages": 1, "BK": 16, "BV": 64, "PREFETCH": 1},
    "dqk_blocks": {"num_warps": 4, "num_stages": 1, "BK": 32, "BV": 32},
}
# The dq/dk stage's loads ahead paid with triton 3.6, where the stage spills nothing (ptxas, sm_90, bf16). From 3.8
# on it spills without them already, more with them (3.8: 168 -> 216 B per thread; 3.9: 232 -> 272, over the compile
# tests' bound), so there the stage keeps its default order.
if (triton_release() or (0,)) >= (3, 8):
    for _stage in ("dqk", "dqk_split"):
        del LAUNCH[_stage]["PREFETCH"]

# Flags of a stage's schedule that its entry of LAUNCH may set, per stage (the kernel documents them; absent, the
# kernel's default, 0): the order of loads and stores, tiles held across a loop.
SCHEDULE_FLAGS: dict[str, tuple[str, ...]] = {
    "dqk": ("PREFETCH", "HOLD_DM", "HOLD_DOE"),
    "dqk_split": ("PREFETCH", "HOLD_DM"),  # HOLD_DOE spills 344 B per thread there (ptxas, sm_90)
    "dv": ("PREFETCH", "LATE_STORE"),
}

# The output stage's form: below FEW_ITEMS_PER_SM (chunk slot, value head) pairs per SM the 16-bit path takes a
# program per item at value tile 64 rather than a program per SM walking 128-wide items, since a short prompt leaves
# the loop little to pipeline: at B1 T1024 H32 bf16 (4.1 pairs per SM) 2 µs off the forward under a CUDA graph on an
# H200; from T = 2048 (8.0 pairs per SM) the per-SM loop is the faster.
FEW_ITEMS_PER_SM = 6
# The prepare stage's block pass after the anchored one: the flags read FLAG_BLOCK at a time by at most one program
# per SM (the kernel holds one program per SM at a time anyway).
FLAG_BLOCK = 128


# The recurrent kernels: fixed per shape (no autotune). The forward's value tile of at most 64 with 2 warps at
# K = V = 128: the decode step under a CUDA graph on an H200 at B = 64 in 7 % less time than with BV 32 / 4 warps.
RECURRENT_BV_MAX = 64
# A K-first pool of 16-bit states: BV 32 with 1 warp (the B = 64 serving step 49.9 µs against 51.6 at BV 64).
RECURRENT_BV_MAX_16BIT = 32
# A V-first state: each tile row is a whole key row (contiguous) whatever BV, so narrow tiles still read whole rows
# and give more programs: BV 16 with 1 warp, the B = 64 serving step on a bf16 pool 42.1 µs against 45.6 at BV 64.
RECURRENT_BV_MAX_V_FIRST = 16
RECURRENT_ELEMENTS_PER_WARP = 4096  # state elements per warp: 128 fp32 registers per thread for the state tile
# The backward holds about five [BV, BK] tiles at once (S_{t-1}, St, S_t, G, dSt): half the forward's elements per
# warp; BV = 32 with 8 warps uses 232-254 registers and no stack at K = V = 128 and 256 (ptxas, sm_90), BV = 64 spills.
RECURRENT_BWD_BV_MAX = 32
RECURRENT_BWD_ELEMENTS_PER_WARP = 512


def recurrent_config(K: int, V: int, v_first: bool = False, state_bytes: int = 4) -> tuple[int, int, int]:
    """``(BK, BV, num_warps)`` of the recurrent forward for head dimensions ``K, V`` and states of ``state_bytes``
    per element (0: no state read or written) in the layout of ``v_first``: the whole key dimension in one tile (the
    l2norm stays local to a program). Not cached: the forward caches its whole launch per shape."""
    BK = pow2(K, 1)
    if v_first and state_bytes > 0:
        bv_max = RECURRENT_BV_MAX_V_FIRST
    elif 0 < state_bytes <= 2:
        bv_max = RECURRENT_BV_MAX_16BIT
    else:
        bv_max = RECURRENT_BV_MAX
    BV = min(pow2(V, 1), bv_max, RECURRENT_BV_MAX)
    return BK, BV, min(8, max(1, BK * BV // RECURRENT_ELEMENTS_PER_WARP))


def recurrent_bwd_config(K: int, V: int) -> tuple[int, int, int]:
    """``(BK, BV, num_warps)`` of the recurrent backward: the forward's key tile, value tiles of at most 32."""
    BK, BV, _ = recurrent_config(K, V)
    BV = min(BV, RECURRENT_BWD_BV_MAX)
    return BK, BV, min(8, max(1, BK * BV // RECURRENT_BWD_ELEMENTS_PER_WARP))


# Where a head dimension narrows a stage's tile, at most one warp per 16 x 16 block of a chunk's rows by that tile:
# with more warps than that Triton 3.6's products read past their shared-memory operands (compute-sanitizer on an
# H200: "Invalid __shared__ read of size 256 bytes" in the backward's dq/dk kernel at K = V = 16 with 8 warps).
WARP_BLOCK = 16 * 16


def launch(stage: str, table: Mapping[str, Mapping[str, int]] = LAUNCH, **tiles: int) -> dict[str, int]:
    """The ``num_warps``/``num_stages`` (and ``maxnreg`` where configured) of ``stage``'s kernel in ``table`` (the
    test-only stage kernels keep a table of their own), and each tile of ``tiles`` (``name=dim``) as the configured
    tile capped at ``pow2(dim)``: keyword arguments for the launch. The warps are capped by :data:`WARP_BLOCK`."""
    cfg = table[stage]
    out = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if "maxnreg" in cfg:  # a register cap per thread, for a stage that runs more programs per SM under it
        out["maxnreg"] = cfg["maxnreg"]
    for flag in SCHEDULE_FLAGS.get(stage, ()):
        if flag in cfg:
            out[flag] = cfg[flag]
    narrowed = [pow2(dim) for name, dim in tiles.items() if pow2(dim) < cfg[name]]
    for name, dim in tiles.items():
        out[name] = min(pow2(dim), cfg[name])
    if narrowed:
        out["num_warps"] = min(out["num_warps"], max(1, CHUNK_SIZE * min(narrowed) // WARP_BLOCK))
    return out


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compute_dtype(x: Tensor) -> Any:
    """Triton compute type: fp64 for fp64 inputs (exact checks), fp32 otherwise."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def contiguous(x: Tensor) -> Tensor:
    return x if x.is_contiguous() else x.contiguous()


def flat(x: Tensor) -> Tensor:
    """``[B, T, ...]`` to the flat token stream ``[B*T, ...]`` (contiguous)."""
    return contiguous(x).flatten(0, 1)


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
    do_not_specialize=["B", "T", "NC", "nch", "NI", "NSEG", "NSLOT", "NCKPT", "CKPT_EVERY"],
    do_not_specialize_on_alignment=["slot_start", "slot_count", "cu", "chunk_off", "Nk", "Nq", "Nrm", "Rqk"],
)


def pdl(device: torch.device) -> Mapping[str, bool]:
    """Launch options of the kernels that open with :func:`pdl_enter`: programmatic dependent launch where the GPU
    has it (sm_90 and later, compiled rather than interpreted), so that a kernel's programs are launched, and wait,
    while the kernel before them finishes, instead of after it (the launch latency off the stream's critical path):
    3 µs off the forward at B1 T1024 H32 bf16 under a CUDA graph on an H200.
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


_poison = False


@contextlib.contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    """Fill the outputs of every Triton launcher with NaN (or -1 for integer buffers) before its kernel runs."""
    global _poison
    old, _poison = _poison, enabled
    try:
        yield
    finally:
        _poison = old


def poison(*tensors: Tensor | None) -> None:
    """Fill ``tensors`` with NaN when :func:`poison_outputs` is active; a no-op (one bool test) otherwise."""
    if not _poison:
        return
    for t in tensors:
        if t is not None and t.numel() > 0:
            t.fill_(float("nan") if t.is_floating_point() else -1)


# ----------------------------------------------------------------------------------------------- forced forms


@dataclass
class Forms:
    """Kernel forms a launch would otherwise pick from the shapes and the machine, forced (None: pick as usual).

    scan_block_v:    the value tile of the chunk scan (:func:`~kda_ops.triton.chunk.scan.scan_block_v`)
    output_per_item: the chunk output stage's form: a program per item (True, the short-prompt form, CUDA only)
                     or a program per SM walking the items (False)
    scan_segments:   segments per sequence of the chunk scans (:func:`~kda_ops.triton.chunk.scan.scan_segments`)
    """

    scan_block_v: int | None = None
    output_per_item: bool | None = None
    scan_segments: int | None = None


forced = Forms()


@contextlib.contextmanager
def force_forms(
    scan_block_v: int | None = None, output_per_item: bool | None = None, scan_segments: int | None = None
) -> Iterator[None]:
    """Launch the given forms inside the block (:func:`kda_ops.warmup` compiles each; tests and benchmarks run them)."""
    old = replace(forced)
    forced.scan_block_v, forced.output_per_item, forced.scan_segments = scan_block_v, output_per_item, scan_segments
    try:
        yield
    finally:
        forced.scan_block_v, forced.output_per_item, forced.scan_segments = (
            old.scan_block_v,
            old.output_per_item,
            old.scan_segments,
        )


_CPU = torch.device("cpu")
# Under the interpreter ``@triton.jit`` made interpreted functions at import: fixed for the process.
_INTERPRETING = interpreting()
