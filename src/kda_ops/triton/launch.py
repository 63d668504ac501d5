"""A cached launcher for the kernels whose host cost per call matters (the eager decode step).

``kernel[grid](*args, **meta)`` binds every argument, computes Triton's specialization key (dtype and 16-byte
alignment of each pointer, ``== 1`` and divisibility by 16 of each integer, the constexprs), looks the compiled
kernel up and, with Triton 3.6, builds launch metadata for its (empty) hook chains, on every call. :class:`Launcher`
does the lookup once per *launch key* and then calls the compiled kernel's launcher directly.

Measured: the recurrent launch (``bench_recurrent.py``'s "launch_forward" row) took 29-31 µs of host time on the
H200 machine both through Triton and through the first version of this class (2026-11-29): that version's own key
(~7.5 µs of Python on a 2-core CI-class CPU) cost what it saved. This version builds the key in ~2.3 µs and passes
the arguments without re-ordering them (~4.5 µs in all, against ~7.5 µs); its effect on the H200 host is not
measured yet.

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


_CPU = torch.device("cpu")
# Under the interpreter ``@triton.jit`` made interpreted functions at import: fixed for the process.
_INTERPRETING = interpreting()

__all__ = ["Launcher"]
