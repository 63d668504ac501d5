"""A cached launcher for the kernels whose host cost per call matters (the eager decode step).

``kernel[grid](*args, **meta)`` binds every argument, computes Triton's specialization key (dtype and 16-byte
alignment of each pointer, ``== 1`` and divisibility by 16 of each integer, the constexprs) and looks the compiled
kernel up, on every call: about 26 µs a launch on the H200's host, a third of an eager decode step. :class:`Launcher`
does the lookup once per *launch key* and then calls the compiled kernel directly.

The launch key is a refinement of Triton's specialization key, so that a hit always finds the kernel Triton itself
would have picked: the caller's ``meta_key`` (which must determine ``meta``: the constexprs and launch options), the
device, and per runtime argument its class: a tensor's dtype and ``data_ptr() % 16``, an integer's ``value % 16``,
``value == 1`` and whether it needs 64 bits, a float, or None. A miss launches through Triton (compiling if needed)
and keeps the compiled kernel. The cached path is taken only where it is exact: on CUDA, outside the interpreter,
with no launch hook installed (profilers install one; they then see every launch through Triton's own path). That
the cached path launches what Triton's own path launches is checked on the GPU (``tests/gpu``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import triton
from torch import Tensor

from kda_ops.triton.chunk_common import interpreting


def _arg_class(x: Any) -> Hashable:
    if isinstance(x, Tensor):
        return (x.dtype, x.data_ptr() & 15)
    if x is None:
        return None
    if isinstance(x, bool):
        return ("b", x)
    if isinstance(x, int):
        return (x & 15, x == 1, -(2**31) <= x < 2**31)
    if isinstance(x, float):
        return "f"
    raise TypeError(f"Launcher: unsupported runtime argument of type {type(x).__name__}")


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
        device = args[0].device if isinstance(args[0], Tensor) else None
        if device is None or device.type != "cuda" or interpreting() or _hooked():
            self.kernel[grid](*args, **meta)
            return
        key = (tuple(meta.items()) if meta_key is None else meta_key, device.index, *map(_arg_class, args))
        hit = self._cache.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **meta)
            self._cache[key] = (compiled, self._layout(meta) if compiled is not None else None)
            return
        compiled, layout = hit
        if layout is None:  # no compiled kernel to call directly: Triton's own path every time
            self.kernel[grid](*args, **meta)
            return
        it = iter(args)
        values = [next(it) if slot is _RUNTIME else slot for slot in layout]
        g = (*grid, 1, 1)
        compiled.run(g[0], g[1], g[2], _raw_stream(device.index), compiled.function, compiled.packed_metadata, None,
                     None, None, *values)  # fmt: skip

    def _layout(self, meta: dict[str, Any]) -> tuple[Any, ...] | None:
        """Every parameter of the kernel in order: the constexpr's value, or a marker for the next runtime argument
        (None when ``meta`` lacks a constexpr: such launches keep Triton's path, which applies the default)."""
        names = [p.name if p.is_constexpr else None for p in self.kernel.params]
        if any(name is not None and name not in meta for name in names):
            return None
        return tuple(_RUNTIME if name is None else meta[name] for name in names)


def _raw_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as a raw handle (what Triton's own launch passes)."""
    return int(_get_raw_stream(index))


_get_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream
)


_RUNTIME = object()

__all__ = ["Launcher"]
