"""Pure-PyTorch KDA: the oracle for every kernel and the CPU kernels of the ops."""

from kda_ops.common import Options
from kda_ops.reference.chunk.backward import chunk_bwd
from kda_ops.reference.chunk.forward import chunk_fwd, chunk_fwd_states, chunk_update
from kda_ops.reference.inputs import beta_transform, gate, l2norm
from kda_ops.reference.naive import naive_recurrent_kda
from kda_ops.reference.recurrent.forward import recurrent_fwd, recurrent_update

__all__ = [
    "Options",
    "beta_transform",
    "chunk_bwd",
    "chunk_fwd",
    "chunk_fwd_states",
    "chunk_update",
    "gate",
    "l2norm",
    "naive_recurrent_kda",
    "recurrent_fwd",
    "recurrent_update",
]
