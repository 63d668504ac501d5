"""What the chunk GPU tests share: the sync-and-poison check around a call, and the opt-in to Triton on CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kda_ops import ops


@contextlib.contextmanager
def checked() -> Iterator[None]:
    """Around a kernel call: host syncs raise, and every launcher's outputs start as NaN."""
    from kda_ops.triton.debug import poison_outputs

    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with poison_outputs():
            yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


@pytest.fixture
def triton_chunk_on_cuda() -> Iterator[None]:
    """The chunk tests run the Triton kernels on CUDA even when an op is out of ops.CUDA_VERIFIED."""
    with ops.cuda_triton("chunk", "chunk_bwd"):
        yield
