"""What the GPU tests share: the sync-and-poison check around a call, and the count of compiled variants of Triton
kernels (what a warm-up must leave unchanged)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def checked() -> Iterator[None]:
    """Around a kernel call: host syncs raise, and every launcher's outputs start as NaN."""
    from kda_ops.triton.launch import poison_outputs

    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with poison_outputs():
            yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def compiled_variants(*kernels: Any) -> int:
    """How many compiled forms Triton holds for these ``@triton.jit`` kernels, over every device (its per-device
    kernel caches, triton 3.6)."""
    return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())
