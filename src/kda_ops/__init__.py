"""kda-ops: Kimi Delta Attention kernels as typed ``torch.ops.kda`` custom ops.

``import kda_ops`` registers ``torch.ops.kda.*``. Public functions: :func:`chunk_kda` (training, prefill) and
:func:`recurrent_kda` (decode, short sequences); both return ``(o, final_state or None)``.
:func:`recurrent_kda_update_` is the serving step: it updates a pool of states in place and returns ``o``;
:func:`chunk_kda_update_` the same by the chunkwise schedule (chunked prefill into the pool).
:func:`kda_gate` computes the gate's log decay alone (``torch.ops.kda.gate``), for either schedule's ``g``.
:func:`warmup` compiles the Triton kernels before a CUDA-graph capture. :func:`set_checks` (or
``KDA_OPS_CHECKS=1``) turns on the checked mode, which validates on the device the values the fast path trusts.
"""

from kda_ops import ops
from kda_ops._warmup import warmup
from kda_ops.api import chunk_kda, chunk_kda_update_, kda_gate, recurrent_kda, recurrent_kda_update_
from kda_ops.checks import checks_enabled, set_checks

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "checks_enabled",
    "chunk_kda",
    "chunk_kda_update_",
    "kda_gate",
    "ops",
    "recurrent_kda",
    "recurrent_kda_update_",
    "set_checks",
    "warmup",
]
