"""Triton kernels of the ``torch.ops.kda`` ops, keyed by op name (see :data:`kda_ops.ops.TRITON_KERNELS`).

Imported lazily by :mod:`kda_ops.ops` (the package imports on a CPU without triton). Each entry has the signature
of the op's reference kernel. Nothing here imports :mod:`kda_ops.reference`: the tests compare the two.

``chunk/`` holds the chunkwise schedule (forward stages, backward stages, their drivers), ``recurrent/`` the fused
recurrent one (forward and serving step, backward); :mod:`~kda_ops.triton.lang` the device helpers every family
shares and :mod:`~kda_ops.triton.launch` every launch configuration.
"""

from collections.abc import Callable
from typing import Any

from kda_ops.triton.chunk.backward import chunk_bwd, chunk_bwd_saved
from kda_ops.triton.chunk.forward import chunk_fwd, chunk_fwd_states, chunk_fwd_train, chunk_update
from kda_ops.triton.chunk.scan import block_v_choices
from kda_ops.triton.launch import force_forms
from kda_ops.triton.recurrent.backward import recurrent_bwd
from kda_ops.triton.recurrent.forward import recurrent_fwd, recurrent_update

KERNELS: dict[str, Callable[..., Any]] = {
    "chunk": chunk_fwd,
    "chunk_states": chunk_fwd_states,
    "chunk_bwd": chunk_bwd,
    "chunk_train": chunk_fwd_train,
    "chunk_bwd_saved": chunk_bwd_saved,
    "chunk_update_": chunk_update,
    "recurrent": recurrent_fwd,
    "recurrent_bwd": recurrent_bwd,
    "recurrent_update_": recurrent_update,
}


def chunk_forms(V: int) -> list[dict[str, Any]]:
    """Every form of the chunk forward a call with value head dimension ``V`` can launch, as :func:`force_forms`
    arguments: each value tile of the scan, the split scan (its passes at the smallest tile, for any segment
    count), then the output stage's two forms."""
    scans: list[dict[str, Any]] = [{"scan_block_v": bv} for bv in block_v_choices(V)]
    return [*scans, {"scan_segments": 2}, {"output_per_item": False}, {"output_per_item": True}]


__all__ = ["KERNELS", "chunk_forms", "force_forms"]
