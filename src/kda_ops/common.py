"""Small pieces every layer shares: the option set and the shapes of each op's outputs.

The fake (meta) functions of the ops and the kernel launchers allocate outputs through the same helpers, so
the shapes and dtypes a compiled graph expects are the ones the kernels write.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass

import torch
from torch import Tensor

# Tokens per chunk of the chunkwise schedule (the Triton kernels' BT, the reference's default).
CHUNK_SIZE = 64
# The l2norm of q and k: x / sqrt(sum(x * x) + L2NORM_EPS), in the reference and every kernel.
L2NORM_EPS = 1e-6
# The smallest per-token log decay the kernels use: a g below it, -inf included (a hard reset), acts as it.
# exp(-200) is 0 in fp32 and 1e-87 in fp64, so the state is forgotten as by -inf, while a chunk's cumulative sums
# and their differences stay finite (-inf - -inf is NaN).
LOG_DECAY_FLOOR = -200.0


@dataclass(frozen=True)
class Options:
    """The keyword options of the public contract that change the math (``scale`` aside), and the layout of the
    states in memory: ``state_v_first`` for ``[N, HV, V, K]`` (every state input and output, the serving pool
    included), else ``[N, HV, K, V]``."""

    use_qk_l2norm: bool = False
    use_gate: bool = False
    use_beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    lower_bound: float | None = None
    state_v_first: bool = False


def state_dtype(v: Tensor) -> torch.dtype:
    """The recurrent state is float32, or float64 for float64 inputs: also the kernels' compute dtype as a torch
    dtype (for their fp32 buffers)."""
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def num_sequences(q: Tensor, cu_seqlens: Tensor | None) -> int:
    """``N``: the batch size, or ``len(cu_seqlens) - 1``."""
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def state_shape(N: int, HV: int, K: int, V: int, state_v_first: bool) -> tuple[int, int, int, int]:
    """The shape of ``N`` states: ``[N, HV, V, K]`` with ``state_v_first``, else ``[N, HV, K, V]``."""
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


def transposed(state: Tensor) -> Tensor:
    """A state tensor in the other layout (``[..., K, V]`` to ``[..., V, K]`` or back), contiguous: a copy."""
    return state.transpose(-1, -2).contiguous()


def forward_outputs(
    q: Tensor, v: Tensor, cu_seqlens: Tensor | None, output_final_state: bool, state_v_first: bool = False
) -> tuple[Tensor, Tensor]:
    """Uninitialised ``o [B, T, HV, V]`` (v's dtype) and final state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
    ``state_v_first``; ``(0,)`` when not asked), contiguous whatever v's strides: the kernels write ``o`` as a
    contiguous tensor, and the fake functions must give the strides the kernels return."""
    K = q.shape[-1]
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    shape = state_shape(num_sequences(q, cu_seqlens), HV, K, V, state_v_first) if output_final_state else (0,)
    return o, v.new_empty(shape, dtype=state_dtype(v))


def chunk_states_dtype(v: Tensor) -> torch.dtype:
    """dtype of the per-chunk states out of the chunk forward: the input's for 16-bit inputs (the dtype the chunk
    kernels keep them in), else the state dtype."""
    return v.dtype if v.dtype in (torch.float16, torch.bfloat16) else state_dtype(v)


def backward_outputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised gradients shaped like their inputs, contiguous (as :func:`forward_outputs`); ``(0,)`` for an
    absent optional input."""

    def like(x: Tensor | None) -> Tensor:
        return q.new_empty(0) if x is None else torch.empty_like(x, memory_format=torch.contiguous_format)

    return (like(q), like(k), like(v), like(g), like(beta), like(initial_state), like(A_log), like(dt_bias))


# The oldest triton the Triton kernels are tested with (the CPU matrix's interpreter legs, the H200's compiled
# kernels); older releases lack language features they use (programmatic dependent launch among them).
TRITON_MIN = (3, 6)


@functools.cache
def triton_version() -> str | None:
    """The installed triton's version, read from its package metadata (triton is not imported), or None."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def triton_release() -> tuple[int, ...] | None:
    """The installed triton's ``(major, minor)``, or None."""
    v = triton_version()
    return None if v is None else tuple(int(p) for p in re.findall(r"\d+", v)[:2])


@functools.cache
def triton_usable() -> bool:
    """Whether a triton of at least :data:`TRITON_MIN` is installed (asked on every Triton op call: cached)."""
    release = triton_release()
    return release is not None and release >= TRITON_MIN


def check_triton(what: str) -> None:
    """Raise an ImportError that says why ``what`` (an op's Triton kernel) cannot run, unless triton is usable."""
    if not triton_usable():
        found = triton_version()
        have = "triton is not installed" if found is None else f"found triton {found}"
        need = ".".join(map(str, TRITON_MIN))
        raise ImportError(f"{what}: the Triton kernels need triton >= {need} ({have}); install triton>={need} "
                          "(a CUDA torch >= 2.10 brings one)")
