"""The ``torch.ops.kda`` operators: schemas, fake functions, device kernels and autograd.

Every op is a typed ``torch.library`` operator with a fake (meta) function: opaque to Inductor, traceable by
``torch.compile(fullgraph=True)`` and ``torch.export``, capturable in CUDA graphs. The forward ops and the
serving op are defined with ``Library.define`` (the eager path pays less host time per call), the backward ops and
the training pair with ``custom_op``; autograd is registered with ``torch.library.register_autograd``. Optional
tensor inputs are ``Tensor?``; an output that was not asked for is an empty ``(0,)`` tensor (an op cannot return
``None``); the public functions in :mod:`kda_ops.api` turn it into ``None``.

Schemas (``torch.ops.kda.*``)::

    chunk(q, k, v, g, beta, float scale, Tensor? initial_state, Tensor? cu_seqlens, Tensor? A_log,
          Tensor? dt_bias, float? lower_bound, bool output_final_state, bool use_qk_l2norm_in_kernel,
          bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval,
          bool state_v_first=False)
        -> (Tensor o, Tensor final_state)
    recurrent(...)                      same schema as chunk
    chunk_bwd(do, Tensor? dht, q, k, v, g, beta, float scale, Tensor? initial_state, Tensor? cu_seqlens,
              Tensor? A_log, Tensor? dt_bias, float? lower_bound, bool use_qk_l2norm_in_kernel,
              bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval,
              bool state_v_first=False)
        -> (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)
    recurrent_bwd(...)                  same schema as chunk_bwd
    chunk_train(...)                    chunk's schema -> (o, final_state, Mqk, Qt, Kend, Gl, Tm, W, Hin, E,
                                        norms): the forward of a training step, keeping the factors its backward
                                        reads (Triton kernels only); differentiable in o and final_state
    chunk_bwd_saved(do, Tensor? dht, q, k, v, g, beta, float scale, Tensor? initial_state, Tensor? cu_seqlens,
                    Tensor? A_log, Tensor? dt_bias, Mqk, Qt, Kend, Gl, Tm, W, Hin, E, norms,
                    float? lower_bound, bool x 4, bool state_v_first=False)
        -> (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)
    recurrent_update_(q, k, v, g, beta, Tensor(a!) state_pool, Tensor state_indices, float scale,
                      Tensor? cu_seqlens, Tensor? A_log, Tensor? dt_bias, float? lower_bound,
                      bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel,
                      bool allow_neg_eigval, bool state_v_first=False, Tensor? num_accepted_tokens=None,
                      bool write_states=True) -> Tensor o
        the serving step: reads and writes state_pool [S, HV, K, V] in place at state_indices [N] (-1: padding);
        with state_indices [N, T_spec] (speculative verify) it starts sequence n from slot
        state_indices[n, num_accepted_tokens[n] - 1] (column 0 without num_accepted_tokens) and writes the state
        after its t-th token to slot state_indices[n, t]; write_states=False writes no state. Defined with
        Library.define rather than custom_op (eager overhead, see its section), not differentiable
    chunk_update_(q, k, v, g, beta, Tensor(a!) state_pool, Tensor state_indices, float scale, Tensor? cu_seqlens,
                  Tensor? A_log, Tensor? dt_bias, float? lower_bound, bool x 4, bool state_v_first=False,
                  int checkpoint_every=0, Tensor? checkpoint_indices=None) -> Tensor o
        the chunkwise schedule of the serving step (chunked prefill into the pool): each sequence from its slot,
        its final state back into it, in place; with checkpoint_indices [N, C] also the state after every
        checkpoint_every tokens into slot checkpoint_indices[n, m]
    state_v_first (every op with a state): the states in and out, their gradients and the pool are [N, HV, V, K]
        (the layout of vLLM's and SGLang's pools) instead of [N, HV, K, V]; the kernels read and write that layout
        in place, the reference transposes at its boundary
    gate(g, Tensor? A_log, Tensor? dt_bias, float? lower_bound, ScalarType output_dtype) -> Tensor
        the gate alone, g [..., H, K] -> log decay [..., H, K] in output_dtype (computed in float32, float64 for
        float64 inputs); differentiable through
    gate_bwd(dy, g, Tensor? A_log, Tensor? dt_bias, float? lower_bound) -> (dg, dA_log, ddt_bias)

Kernels: the gate ops are elementwise PyTorch on every device. The others: on CUDA the Triton kernels
(:data:`TRITON_KERNELS`); on the CPU the PyTorch reference, or the Triton
kernels under ``TRITON_INTERPRET=1`` when :func:`cpu_backend` selects ``"triton"`` (the test switch). The choice is
explicit: nothing falls back silently when a Triton kernel fails.

The public functions of :mod:`kda_ops.api` call one entry each, :func:`run_chunk`, :func:`run_recurrent` and
:func:`run_update`, which pick the op (the training pair where autograd records a chunk call on the Triton
kernels), and call its kernel function directly where the dispatcher would only pick it (:func:`_direct`).
"""

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from kda_ops import reference, transforms
from kda_ops.common import (
    CHUNK_SIZE,
    Options,
    backward_outputs,
    check_triton,
    chunk_states_dtype,
    forward_outputs,
    num_sequences,
    state_dtype,
    state_shape,
)
from kda_ops.varlen import chunk_states_shape

# Ops with a Triton kernel: on CUDA they run it; on the CPU under the "triton" CPU backend (the interpreter tests).
TRITON_KERNELS: frozenset[str] = frozenset(
    {"chunk", "chunk_states", "chunk_bwd", "chunk_train", "chunk_bwd_saved", "recurrent", "recurrent_bwd",
     "recurrent_update_", "chunk_update_"}  # fmt: skip
)

_cpu_backend = os.environ.get("KDA_OPS_CPU_BACKEND", "reference")


@contextlib.contextmanager
def cpu_backend(name: str) -> Iterator[None]:
    """Route CPU calls of the ops to ``"reference"`` (default) or ``"triton"`` (needs ``TRITON_INTERPRET=1``)."""
    global _cpu_backend
    if name not in ("reference", "triton"):
        raise ValueError(f"cpu_backend: expected 'reference' or 'triton', got {name!r}")
    old, _cpu_backend = _cpu_backend, name
    try:
        yield
    finally:
        _cpu_backend = old


# fp64 chunk kernels hold their tiles in shared memory at 8 bytes an element: beyond head dimension 128 the output
# stage alone asks 320 KB of an H200's 227 KB (K = V = 256), so those calls run the reference on every device.
FP64_CHUNK_MAX_DIM = 128


def uses_triton(op: str, device: torch.device, q: Optional[Tensor] = None, v: Optional[Tensor] = None) -> bool:
    """Whether ``torch.ops.kda.<op>`` runs its Triton kernel for tensors on ``device`` (else the reference); with
    ``q`` and ``v``, for those inputs (fp64 chunk calls above :data:`FP64_CHUNK_MAX_DIM` run the reference)."""
    if op not in TRITON_KERNELS:
        return False
    if (op.startswith("chunk") and q is not None and v is not None and q.dtype == torch.float64
            and max(q.shape[-1], v.shape[-1]) > FP64_CHUNK_MAX_DIM):  # fmt: skip
        return False
    return device.type == "cuda" or (device.type == "cpu" and _cpu_backend == "triton")


def _triton_only(op: str, device: torch.device) -> Callable[..., Any]:
    """The Triton kernel of an op without a reference kernel (the training pair), or a clear error where the Triton
    kernels do not run."""
    if not uses_triton(op, device):
        raise NotImplementedError(
            f"kda::{op} runs only where the Triton kernels run (not on {device} here); call kda::chunk, whose "
            "backward recomputes the factors"
        )
    return _triton_kernel(op)


def _triton_kernel(op: str) -> Callable[..., Any]:
    check_triton(f"kda::{op}")
    from kda_ops import triton as kt  # imported lazily: the package works on CPU without triton

    fn: Callable[..., Any] = kt.KERNELS[op]
    return fn


@functools.lru_cache(maxsize=256)
def _options(
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_gate: bool,
    use_beta_sigmoid: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = False,
) -> Options:
    """The options of one call (cached: Options is frozen, and building one is a cost of every eager call)."""
    return Options(use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, lower_bound, state_v_first)


# -------------------------------------------------------------------------------------- eager fast path

# The kernel function of each forward op and of the serving op: what the dispatcher calls on every backend.
_DIRECT_DEVICES = ("cpu", "cuda")
_DIRECT: dict[Any, Callable[..., Any]] = {}


def _direct(op: Any, tensors: tuple[Optional[Tensor], ...]) -> Optional[Callable[..., Any]]:
    """The function that ``op`` (a forward op or the serving op) would run on these tensor inputs, when calling it
    directly is the same call; else None (call the op).

    It is the same call when the dispatcher would do nothing but pick it: the call is eager (not traced by
    ``torch.compile`` or ``torch.export``), the tensors are on the CPU or a CUDA device (those the op's kernel
    serves: on the meta device the dispatcher runs the fake kernel), no torch function or dispatch mode is active,
    every tensor is a plain ``torch.Tensor`` (no fake, functional or subclass tensor) and, with grad mode on, none
    requires grad (autograd would record the op). An eager decode step then skips ~9 µs of dispatcher, ~12 µs
    outside inference_mode (H200 host, torch 2.11). Checking costs ~0.5 µs.
    """
    fn = _DIRECT.get(op)
    if (
        fn is None
        or tensors[0] is None
        or tensors[0].device.type not in _DIRECT_DEVICES  # meta tensors: the dispatcher picks the fake kernel
        or torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
    ):
        return None
    grad = torch.is_grad_enabled()
    for x in tensors:
        if x is not None and (type(x) is not Tensor or (grad and x.requires_grad)):
            return None
    return fn


# ----------------------------------------------------------------------------------------------- forward


_FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, Tensor? cu_seqlens, "
    "Tensor? A_log, Tensor? dt_bias, float? lower_bound, bool output_final_state, bool use_qk_l2norm_in_kernel, "
    "bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, bool state_v_first=False) "
    "-> (Tensor, Tensor)"
)
# The forward ops and the serving op are defined with the low-level Library API; the backward ops with custom_op.
# The forward is what an eager decode or short prefill pays per call: custom_op's Python wrappers cost ~7 µs more
# a call than a Library op with the same autograd formula (``register_autograd``) and ~5.5 µs more under
# inference_mode, where the dispatcher skips the autograd kernel altogether (torch 2.13, CPU, measured with a stub
# kernel). The backward ops keep custom_op for its clear error on a double backward.
_lib = torch.library.Library("kda", "FRAGMENT")


def _forward(op: str, ref: Callable[..., tuple[Tensor, ...]], states: bool = False) -> Any:
    """Define the forward op ``kda::<op>`` whose reference kernel is ``ref``; return its OpOverload. With ``states``
    it returns a third tensor, the state entering each chunk (:func:`kda_ops.varlen.chunk_states`)."""
    _lib.define(op + (_FORWARD_SCHEMA.replace("-> (Tensor, Tensor)", "-> (Tensor, Tensor, Tensor)") if states
                      else _FORWARD_SCHEMA))  # fmt: skip

    def fwd(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: float,
        initial_state: Optional[Tensor],
        cu_seqlens: Optional[Tensor],
        A_log: Optional[Tensor],
        dt_bias: Optional[Tensor],
        lower_bound: Optional[float],
        output_final_state: bool,
        use_qk_l2norm_in_kernel: bool,
        use_gate_in_kernel: bool,
        use_beta_sigmoid_in_kernel: bool,
        allow_neg_eigval: bool,
        state_v_first: bool = False,
    ) -> tuple[Tensor, ...]:
        opts = _options(
            lower_bound, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            state_v_first,
        )  # fmt: skip
        kernel = _triton_kernel(op) if uses_triton(op, q.device, q, v) else ref
        return kernel(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts, output_final_state)

    def fake(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: float,
        initial_state: Optional[Tensor],
        cu_seqlens: Optional[Tensor],
        A_log: Optional[Tensor],
        dt_bias: Optional[Tensor],
        lower_bound: Optional[float],
        output_final_state: bool,
        use_qk_l2norm_in_kernel: bool,
        use_gate_in_kernel: bool,
        use_beta_sigmoid_in_kernel: bool,
        allow_neg_eigval: bool,
        state_v_first: bool = False,
    ) -> tuple[Tensor, ...]:
        o, final = forward_outputs(q, v, cu_seqlens, output_final_state, state_v_first)
        if not states:
            return o, final
        B, T, _, K = q.shape
        lead = chunk_states_shape(B, T, num_sequences(q, cu_seqlens), cu_seqlens is not None, CHUNK_SIZE)
        shape = state_shape(0, v.shape[2], K, v.shape[3], state_v_first)[1:]
        return o, final, v.new_empty(*lead, *shape, dtype=chunk_states_dtype(v))

    # every backend, as custom_op registers it (CUDA and the CPU pick their kernel above; other devices run the
    # reference); fake tensors take the fake function below
    _lib.impl(op, fwd, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kda::{op}", fake, lib=_lib)
    overload = getattr(torch.ops.kda, op).default
    _DIRECT[overload] = fwd
    return overload


def _backward(op: str, ref: Callable[..., tuple[Optional[Tensor], ...]]) -> Any:
    """Define the backward op ``kda::<op>``; ``ref`` returns None for absent inputs, the op returns ``(0,)``."""

    @torch.library.custom_op(f"kda::{op}", mutates_args=())
    def bwd(
        do: Tensor,
        dht: Optional[Tensor],
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: float,
        initial_state: Optional[Tensor],
        cu_seqlens: Optional[Tensor],
        A_log: Optional[Tensor],
        dt_bias: Optional[Tensor],
        lower_bound: Optional[float],
        use_qk_l2norm_in_kernel: bool,
        use_gate_in_kernel: bool,
        use_beta_sigmoid_in_kernel: bool,
        allow_neg_eigval: bool,
        state_v_first: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        opts = _options(
            lower_bound, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            state_v_first,
        )  # fmt: skip
        kernel = _triton_kernel(op) if uses_triton(op, q.device, q, v) else ref
        grads = kernel(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts)
        # a fresh empty tensor each: outputs of a custom op may not alias one another; contiguous, as the fake says
        # (the reference's autograd gives gradients the strides of their inputs)
        return tuple(q.new_empty(0) if x is None else x.contiguous() for x in grads)  # type: ignore[return-value]

    @bwd.register_fake
    def _(
        do: Tensor,
        dht: Optional[Tensor],
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: float,
        initial_state: Optional[Tensor],
        cu_seqlens: Optional[Tensor],
        A_log: Optional[Tensor],
        dt_bias: Optional[Tensor],
        *rest: Any,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        return backward_outputs(q, k, v, g, beta, initial_state, A_log, dt_bias)

    return bwd


def _reference_bwd(
    do: Tensor,
    dht: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    opts: Options,
) -> tuple[Optional[Tensor], ...]:
    # Both schedules compute the same function: the chunkwise analytic backward is the CPU kernel of both.
    return reference.chunk_bwd(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts)


chunk = _forward("chunk", reference.chunk_fwd)
chunk_states = _forward("chunk_states", reference.chunk_fwd_states, states=True)
recurrent = _forward("recurrent", reference.recurrent_fwd)
chunk_bwd = _backward("chunk_bwd", _reference_bwd)
recurrent_bwd = _backward("recurrent_bwd", _reference_bwd)


# ------------------------------------------------------------------------------------------ training pair

# kda::chunk_train returns the Triton pipeline's per-chunk factors beside (o, final_state), and its backward
# kda::chunk_bwd_saved reads them instead of running the forward's kernels again (docs/architecture.md, "Chunk
# backward: what is saved"). custom_op: a training step pays its Python wrappers once per layer, not per token.
_Out11 = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("kda::chunk_train", mutates_args=())
def chunk_train(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = False,
) -> _Out11:
    opts = _options(
        lower_bound, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        state_v_first,
    )  # fmt: skip
    kernel = _triton_only("chunk_train", q.device)
    out: _Out11 = kernel(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts, output_final_state)
    return out


@chunk_train.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = False,
) -> _Out11:
    from kda_ops.triton.chunk.recompute import recomputed_empty  # the op runs only where triton does

    o, final = forward_outputs(q, v, cu_seqlens, output_final_state, state_v_first)
    fw = recomputed_empty(q, v, num_sequences(q, cu_seqlens))
    B, T, H = q.shape[:3]
    norms = q.new_empty(2, B * T, H, dtype=state_dtype(v)) if use_qk_l2norm_in_kernel else q.new_empty(0)
    return (o, final, fw.Mqk, fw.Qt, fw.Kend, fw.Gl, fw.Tm, fw.W, fw.Hin, fw.E, norms)


@torch.library.custom_op("kda::chunk_bwd_saved", mutates_args=())
def chunk_bwd_saved(
    do: Tensor,
    dht: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    Mqk: Tensor,
    Qt: Tensor,
    Kend: Tensor,
    Gl: Tensor,
    Tm: Tensor,
    W: Tensor,
    Hin: Tensor,
    E: Tensor,
    norms: Tensor,
    lower_bound: Optional[float],
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = _options(
        lower_bound, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        state_v_first,
    )  # fmt: skip
    kernel = _triton_only("chunk_bwd_saved", q.device)
    saved = (Mqk, Qt, Kend, Gl, Tm, W, Hin, E, norms)
    grads = kernel(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, opts, saved)
    return tuple(q.new_empty(0) if x is None else x.contiguous() for x in grads)  # type: ignore[return-value]


@chunk_bwd_saved.register_fake
def _(
    do: Tensor,
    dht: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    *rest: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return backward_outputs(q, k, v, g, beta, initial_state, A_log, dt_bias)


# ----------------------------------------------------------------------------------------------- serving

# The serving step is defined with the low-level Library API rather than custom_op: custom_op wraps a mutating op
# in a Python ADInplaceOrView kernel that re-reads the schema on every call (measured on torch 2.13: ~185 us a
# call for this schema, against ~10 us here). It bumps the pool's version counter itself, and it is not
# differentiable (Autograd falls through: outputs never require grad). Compile and CUDA graphs see the same schema
# with the pool as a mutated argument (Tensor(a!)), so the update is traced, re-inplaced and captured without a copy.
_lib.define(
    "recurrent_update_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state_pool, "
    "Tensor state_indices, float scale, Tensor? cu_seqlens, Tensor? A_log, Tensor? dt_bias, float? lower_bound, "
    "bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, "
    "bool allow_neg_eigval, bool state_v_first=False, Tensor? num_accepted_tokens=None, bool write_states=True) "
    "-> Tensor"
)


def _recurrent_update_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float,
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = False,
    num_accepted_tokens: Optional[Tensor] = None,
    write_states: bool = True,
) -> Tensor:
    opts = _options(
        lower_bound, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        state_v_first,
    )  # fmt: skip
    op = "recurrent_update_"
    kernel = _triton_kernel(op) if uses_triton(op, q.device) else reference.recurrent_update
    torch.autograd.graph.increment_version(state_pool)
    o: Tensor = kernel(q, k, v, g, beta, state_pool, state_indices, scale, cu_seqlens, A_log, dt_bias, opts,
                       num_accepted_tokens, write_states)  # fmt: skip
    return o


def _recurrent_update_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float,
    cu_seqlens: Optional[Tensor],
    *rest: Any,
) -> Tensor:
    return forward_outputs(q, v, cu_seqlens, False)[0]


for _key in ("CPU", "CUDA"):
    _lib.impl("recurrent_update_", _recurrent_update_impl, _key)
_lib.impl("recurrent_update_", torch.library.fallthrough_kernel, "Autograd")
torch.library.register_fake("kda::recurrent_update_", _recurrent_update_fake, lib=_lib)
recurrent_update_ = torch.ops.kda.recurrent_update_.default
_DIRECT[recurrent_update_] = _recurrent_update_impl

# The chunkwise serving step, defined as the recurrent one is (and for the same reasons).
_lib.define(
    "chunk_update_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state_pool, "
    "Tensor state_indices, float scale, Tensor? cu_seqlens, Tensor? A_log, Tensor? dt_bias, float? lower_bound, "
    "bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, "
    "bool allow_neg_eigval, bool state_v_first=False, int checkpoint_every=0, Tensor? checkpoint_indices=None) "
    "-> Tensor"
)


def _chunk_update_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float,
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = False,
    checkpoint_every: int = 0,
    checkpoint_indices: Optional[Tensor] = None,
) -> Tensor:
    opts = _options(
        lower_bound, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        state_v_first,
    )  # fmt: skip
    op = "chunk_update_"
    if checkpoint_indices is not None and (checkpoint_every <= 0 or checkpoint_every % CHUNK_SIZE):
        raise ValueError(f"checkpoint_every: expected a positive multiple of {CHUNK_SIZE} with checkpoint_indices, "
                         f"got {checkpoint_every}")  # fmt: skip
    kernel = _triton_kernel(op) if uses_triton(op, q.device, q, v) else reference.chunk_update
    torch.autograd.graph.increment_version(state_pool)
    o: Tensor = kernel(q, k, v, g, beta, state_pool, state_indices, scale, cu_seqlens, A_log, dt_bias, opts,
                       checkpoint_every, checkpoint_indices)  # fmt: skip
    return o


for _key in ("CPU", "CUDA"):
    _lib.impl("chunk_update_", _chunk_update_impl, _key)
_lib.impl("chunk_update_", torch.library.fallthrough_kernel, "Autograd")
torch.library.register_fake("kda::chunk_update_", _recurrent_update_fake, lib=_lib)
chunk_update_ = torch.ops.kda.chunk_update_.default
_DIRECT[chunk_update_] = _chunk_update_impl


# ---------------------------------------------------------------------------------------------- autograd

_TENSOR_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    (q, k, v, g, beta, scale, h0, cu, A_log, dt_bias, lower_bound, _out_final, *flags) = inputs
    kept = tuple(output[2:])  # kda::chunk_train's factors (none for the other forward ops)
    ctx.save_for_backward(q, k, v, g, beta, h0, cu, A_log, dt_bias, *kept)
    if kept:
        ctx.mark_non_differentiable(*kept)
    # no zero-filled gradients for outputs the loss does not use: the kept factors never get one (zeros of their
    # size: 0.6 ms and 2.1 GB at T = 32k, H = 32 on the H200), nor does the final state in most losses
    ctx.set_materialize_grads(False)
    ctx.scale, ctx.lower_bound, ctx.flags = scale, lower_bound, flags


def _autograd(bwd_op: Any) -> Callable[..., tuple[Optional[Tensor], ...]]:
    def backward(ctx: Any, do: Optional[Tensor], dht: Optional[Tensor], *_kept: Any) -> tuple[Optional[Tensor], ...]:
        q, k, v, g, beta, h0, cu, A_log, dt_bias, *kept = ctx.saved_tensors
        if do is None:  # only the final state reached the loss (o is shaped and typed as v)
            do = torch.zeros_like(v)
        if dht is not None and dht.numel() == 0:
            dht = None
        dq, dk, dv, dg, dbeta, dh0, dA, ddt = bwd_op(
            do, dht, q, k, v, g, beta, ctx.scale, h0, cu, A_log, dt_bias, *kept, ctx.lower_bound, *ctx.flags
        )
        return (
            dq, dk, dv, dg, dbeta, None,
            None if h0 is None else dh0,
            None,
            None if A_log is None else dA,
            None if dt_bias is None else ddt,
            None, None, None, None, None, None, None,
        )  # fmt: skip

    return backward


torch.library.register_autograd("kda::chunk", _autograd(chunk_bwd), setup_context=_setup_context, lib=_lib)
torch.library.register_autograd("kda::recurrent", _autograd(recurrent_bwd), setup_context=_setup_context, lib=_lib)
chunk_train.register_autograd(_autograd(chunk_bwd_saved), setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------- gate

# The gate alone (the formulas of :mod:`kda_ops.transforms`), so that a caller computes the log decay once and
# feeds it to both schedules. Elementwise torch code on every device: no Triton kernel, no host synchronisation.
# Library.define for the forward (a per-layer eager call, as the other forward ops), custom_op for the backward.
_lib.define("gate(Tensor g, Tensor? A_log, Tensor? dt_bias, float? lower_bound, ScalarType output_dtype) -> Tensor")


def _gate_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """float32, or float64 where an input is float64 (the checks' precision)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in tensors) else torch.float32


def _gate_impl(
    g: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    output_dtype: torch.dtype,
) -> Tensor:
    y = transforms.gate(g.to(_gate_dtype(g, A_log, dt_bias)), A_log, dt_bias, lower_bound)
    return y.to(output_dtype).contiguous()  # contiguous as the fake: g may be a strided view


def _gate_fake(
    g: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    output_dtype: torch.dtype,
) -> Tensor:
    return g.new_empty(g.shape, dtype=output_dtype)


_lib.impl("gate", _gate_impl, "CompositeExplicitAutograd")
torch.library.register_fake("kda::gate", _gate_fake, lib=_lib)
gate = torch.ops.kda.gate.default


@torch.library.custom_op("kda::gate_bwd", mutates_args=())
def gate_bwd(
    dy: Tensor, g: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor], lower_bound: Optional[float]
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``kda::gate`` to ``g``, ``A_log`` and ``dt_bias``, each in its input's dtype (``(0,)`` where
    the input is absent)."""
    dtype = _gate_dtype(g, A_log, dt_bias)
    dg, dA, ddt = transforms.gate_bwd(g.to(dtype), A_log, dt_bias, lower_bound, dy.to(dtype))
    return (
        dg.to(g.dtype).contiguous(),
        g.new_empty(0) if A_log is None or dA is None else dA.to(A_log.dtype).view_as(A_log),
        g.new_empty(0) if dt_bias is None or ddt is None else ddt.to(dt_bias.dtype).view_as(dt_bias),
    )


@gate_bwd.register_fake
def _(
    dy: Tensor, g: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor], lower_bound: Optional[float]
) -> tuple[Tensor, Tensor, Tensor]:
    def like(x: Optional[Tensor]) -> Tensor:
        return g.new_empty(0) if x is None else torch.empty_like(x, memory_format=torch.contiguous_format)

    return torch.empty_like(g, memory_format=torch.contiguous_format), like(A_log), like(dt_bias)


def _gate_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    g, A_log, dt_bias, lower_bound, _output_dtype = inputs
    ctx.save_for_backward(g, A_log, dt_bias)
    ctx.lower_bound = lower_bound


def _gate_backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:
    g, A_log, dt_bias = ctx.saved_tensors
    dg, dA, ddt = gate_bwd(dy, g, A_log, dt_bias, ctx.lower_bound)
    return dg, None if A_log is None else dA, None if dt_bias is None else ddt, None, None


torch.library.register_autograd("kda::gate", _gate_backward, setup_context=_gate_setup_context, lib=_lib)


# ------------------------------------------------------------------------------------- the public entries


def trains(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records a call on these inputs (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def run_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    recompute_in_backward: bool,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
) -> tuple[Tensor, ...]:
    """``kda::chunk`` on validated arguments, or the training pair ``kda::chunk_train`` where autograd records the
    call on the Triton kernels and ``recompute_in_backward`` is off (the forward keeps its factors for the
    backward); ``(o, final_state)``. With ``return_intermediate_states`` (not under autograd: the api checks)
    ``kda::chunk_states``: ``(o, final_state, states)``."""
    tensors = (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    op = chunk
    if return_intermediate_states:
        op = chunk_states
    elif not recompute_in_backward and trains(*tensors) and uses_triton("chunk_train", q.device, q, v):
        op = chunk_train
    fn = _direct(op, tensors) or op
    o, final, *_kept = fn(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, lower_bound, output_final_state,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
    )  # fmt: skip
    if return_intermediate_states:
        return o, final, _kept[0]
    return o, final


def run_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor]:
    """``kda::recurrent`` on validated arguments; ``(o, final_state)``."""
    fn = _direct(recurrent, (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)) or recurrent
    o, final = fn(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, lower_bound, output_final_state,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
    )  # fmt: skip
    return o, final


def run_update(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float,
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = False,
    num_accepted_tokens: Optional[Tensor] = None,
    write_states: bool = True,
) -> Tensor:
    """``kda::recurrent_update_`` on validated arguments: the pool updated in place; ``o``."""
    op = recurrent_update_
    tensors = (q, k, v, g, beta, state_pool, state_indices, cu_seqlens, A_log, dt_bias, num_accepted_tokens)
    fn = _direct(op, tensors) or op
    o: Tensor = fn(
        q, k, v, g, beta, state_pool, state_indices, scale, cu_seqlens, A_log, dt_bias, lower_bound,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
        num_accepted_tokens, write_states,
    )  # fmt: skip
    return o


def run_chunk_update(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float,
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = False,
    checkpoint_every: int = 0,
    checkpoint_indices: Optional[Tensor] = None,
) -> Tensor:
    """``kda::chunk_update_`` on validated arguments: the pool updated in place; ``o``."""
    op = chunk_update_
    tensors = (q, k, v, g, beta, state_pool, state_indices, cu_seqlens, A_log, dt_bias, checkpoint_indices)
    fn = _direct(op, tensors) or op
    o: Tensor = fn(
        q, k, v, g, beta, state_pool, state_indices, scale, cu_seqlens, A_log, dt_bias, lower_bound,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
        checkpoint_every, checkpoint_indices,
    )  # fmt: skip
    return o

