"""Triton kernels of the ``torch.ops.kda`` ops, keyed by op name (see :data:`kda_ops.ops.TRITON_KERNELS`).

Imported lazily by :mod:`kda_ops.ops` (the package imports on a CPU without triton). Each entry has the signature
of the op's reference kernel. Nothing here imports :mod:`kda_ops.reference`: the tests compare the two.
"""

from collections.abc import Callable
from typing import Any

from kda_ops.triton.chunk import chunk_fwd
from kda_ops.triton.chunk_bwd import chunk_bwd, chunk_bwd_saved, chunk_fwd_train
from kda_ops.triton.recurrent import recurrent_fwd, recurrent_update
from kda_ops.triton.recurrent_bwd import recurrent_bwd

KERNELS: dict[str, Callable[..., Any]] = {
    "chunk": chunk_fwd,
    "chunk_bwd": chunk_bwd,
    "chunk_train": chunk_fwd_train,
    "chunk_bwd_saved": chunk_bwd_saved,
    "recurrent": recurrent_fwd,
    "recurrent_bwd": recurrent_bwd,
    "recurrent_update_": recurrent_update,
}

__all__ = ["KERNELS"]
