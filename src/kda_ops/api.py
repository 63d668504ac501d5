"""Public functions: argument checks with clear errors, defaults and docstrings. No math, no kernels.

Checks read shapes, dtypes and devices only, never tensor values on an accelerator (no host synchronisation).
The values of ``cu_seqlens`` are the caller's contract: ``cu_seqlens[0] == 0``, non-decreasing,
``cu_seqlens[-1] == T``. They are checked when ``cu_seqlens`` lives on the CPU and the call is eager; on a GPU
they are not read, and values that break the contract give unspecified (but in-bounds) results.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NoReturn, overload

import torch
from torch import Tensor

from kda_ops import checks, ops
from kda_ops.common import CHUNK_SIZE, num_sequences, state_shape

MAX_HEAD_DIM = 256
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(cls: type[Exception], name: str, expected: str, got: Any) -> NoReturn:
    raise cls(f"{name}: expected {expected}, got {got}")


def check_float(name: str, x: Tensor) -> None:
    """A floating-point torch.Tensor, or a TypeError naming the argument (shared with :func:`kda_ops.warmup`)."""
    if not isinstance(x, Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if x.dtype not in _FLOAT:
        _fail(TypeError, name, "a floating-point tensor (float16, bfloat16, float32 or float64)", x.dtype)


def check_indices(name: str, x: object) -> None:
    """An int32 or int64 torch.Tensor, or a TypeError naming the argument."""
    if not isinstance(x, Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if x.dtype not in (torch.int32, torch.int64):
        _fail(TypeError, name, "an int32 or int64 tensor", x.dtype)


def check_cu_seqlens_form(cu_seqlens: Tensor) -> None:
    """``cu_seqlens``' type and shape (its values need the length of the row: :func:`_check_cu_seqlens_values`)."""
    check_indices("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        _fail(ValueError, "cu_seqlens", "a 1-D tensor [N + 1] with N >= 1", f"shape {list(cu_seqlens.shape)}")


def check_slot_range(state_indices: Tensor, S: int) -> None:
    """Slots in ``[0, S)`` or -1 (padding), read from ``state_indices`` (a CPU tensor, or any in the checked mode:
    the caller decides, as reading a device tensor synchronises)."""
    idx = state_indices.flatten().tolist()  # sync-ok: a CPU tensor in eager mode, or the checked mode
    if any(i < -1 or i >= S for i in idx):
        _fail(ValueError, "state_indices", f"slots in [0, {S}) or -1 (padding)",
              state_indices.tolist())  # fmt: skip  # sync-ok: as above


def check_flags(*flags: tuple[str, object]) -> None:
    """Each ``(name, value)`` a bool, or a TypeError naming it (a string or a tensor would be truthy by accident)."""
    for name, value in flags:
        if not isinstance(value, bool):
            _fail(TypeError, name, "a bool", repr(value))


def check_lower_bound(lower_bound: object) -> float:
    """The gate's bound as a Python float: a real number, or a 0-dim CPU tensor (reading it does not synchronise
    with any device; under ``torch.compile`` a tensor's value is not known while tracing, so a float is needed)."""
    if isinstance(lower_bound, Tensor):
        if lower_bound.device.type != "cpu" or lower_bound.dim() != 0 or torch.compiler.is_compiling():
            _fail(TypeError, "lower_bound", "a Python float or a 0-dim CPU tensor in eager mode (reading a "
                  "device tensor's value would synchronise with the device: pass a float)",
                  f"a {lower_bound.dim()}-dim tensor on {lower_bound.device}")  # fmt: skip
        if lower_bound.dtype == torch.bool or lower_bound.is_complex():
            _fail(TypeError, "lower_bound", "a real number", lower_bound.dtype)
        lower_bound = lower_bound.item()  # sync-ok: a CPU tensor, eager only
    value = _finite_float("lower_bound", lower_bound, "<= 0: the log decay is lower_bound * sigmoid(z)")
    # g = lower_bound * sigmoid(z) is a log decay (<= 0): a positive bound would grow the state; 0 means no decay
    if value > 0:
        _fail(ValueError, "lower_bound", "a finite float <= 0 (the log decay is lower_bound * sigmoid(z))", value)
    return value


def _flag(name: str, value: bool) -> bool:
    check_flags((name, value))
    return value


def _check_shape(name: str, x: Tensor, shape: tuple[int, ...], text: str) -> None:
    if x.shape != shape:
        _fail(ValueError, name, f"shape {text} = {list(shape)}", list(x.shape))


def _layout(lead: str, state_v_first: bool) -> str:
    """The expected shape of a state tensor in words, naming the layout."""
    if state_v_first:
        return f"[{lead}, HV, V, K] (the V-first layout of state_v_first=True)"
    return f"[{lead}, HV, K, V] (the K-first layout; state_v_first=True takes [{lead}, HV, V, K])"


def check_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | Tensor | None = None,
    state_v_first: bool = False,
    cu_seqlens_values: bool = True,
    **flags: object,
) -> tuple[float, float | None]:
    """The checks of a ``chunk_kda`` / ``recurrent_kda`` call, in one place for every caller that takes their
    arguments: ``flags`` are the call's other bool options by name. ``cu_seqlens_values=False`` leaves the values of
    ``cu_seqlens`` (on the CPU, and in the checked mode on a device) to the caller: a slice of a row whose length
    only the caller knows. Returns the scale and the gate's lower bound to use."""
    check_flags(("use_gate_in_kernel", use_gate_in_kernel), ("state_v_first", state_v_first), *flags.items())
    return _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
                     lower_bound, state_v_first, cu_seqlens_values)  # fmt: skip


def _validate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    use_gate_in_kernel: bool,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    lower_bound: float | Tensor | None,
    state_v_first: bool = False,
    cu_seqlens_values: bool = True,
) -> tuple[float, float | None]:
    """Check every argument against the contract; return the scale and the gate's lower bound to use."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float(name, x)
    if q.dim() != 4:
        _fail(ValueError, "q", "a 4-D tensor [B, T, H, K]", f"shape {list(q.shape)}")
    B, T, H, K = q.shape
    _check_shape("k", k, (B, T, H, K), "[B, T, H, K] like q")
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T):
        _fail(ValueError, "v", f"shape [B, T, HV, V] with B, T = {B}, {T} (from q)", list(v.shape))
    HV, V = v.shape[2], v.shape[3]
    if H == 0:
        _fail(ValueError, "q", "at least one head (H >= 1)", f"shape {list(q.shape)}")
    if HV == 0 or HV % H != 0:
        _fail(ValueError, "v", f"a number of value heads HV >= 1 that is a multiple of H = {H}", f"HV = {HV}")
    if K == 0 or K > MAX_HEAD_DIM:
        _fail(ValueError, "q", f"a head dimension K in [1, {MAX_HEAD_DIM}]", f"K = {K}")
    if V == 0 or V > MAX_HEAD_DIM:
        _fail(ValueError, "v", f"a head dimension V in [1, {MAX_HEAD_DIM}]", f"V = {V}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        # name the odd one out: q when k and v agree, else the first of k and v that differs from q
        odd = "q" if k.dtype == v.dtype else "k" if k.dtype != q.dtype else "v"
        _fail(TypeError, odd, "q, k and v of one dtype", f"q {q.dtype}, k {k.dtype}, v {v.dtype}")
    _check_shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    _check_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    device = q.device
    others = [("k", k), ("v", v), ("g", g), ("beta", beta)]  # tensors that must live on q's device

    N = B
    if cu_seqlens is not None:
        check_cu_seqlens_form(cu_seqlens)
        if B != 1:
            _fail(ValueError, "cu_seqlens", "batch size B = 1 (sequences are packed along T)", f"B = {B}")
        N = cu_seqlens.shape[0] - 1
        others.append(("cu_seqlens", cu_seqlens))
        if cu_seqlens_values and cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_cu_seqlens_values(cu_seqlens, T)
        elif cu_seqlens_values and checks.active(cu_seqlens):
            _check_cu_seqlens_values(cu_seqlens.cpu(), T)  # sync-ok: checked mode

    if initial_state is not None:
        check_float("initial_state", initial_state)
        _check_shape("initial_state", initial_state, state_shape(N, HV, K, V, state_v_first),
                     _layout("N", state_v_first))  # fmt: skip
        others.append(("initial_state", initial_state))

    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            _fail(ValueError, "A_log", "a tensor [HV] (or a lower_bound) with use_gate_in_kernel=True", None)
        if A_log is not None:
            check_float("A_log", A_log)
            _check_shape("A_log", A_log, (HV,), "[HV]")
            others.append(("A_log", A_log))
        if dt_bias is not None:
            check_float("dt_bias", dt_bias)
            _check_shape("dt_bias", dt_bias, (HV * K,), "[HV * K]")
            others.append(("dt_bias", dt_bias))
        bound = None if lower_bound is None else check_lower_bound(lower_bound)
    else:
        bound = None
        for name, given in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if given is not None:
                _fail(ValueError, name, "None unless use_gate_in_kernel=True", type(given).__name__)

    for name, x in others:
        if x.device != device:
            odd = ", ".join(f"{n} on {t.device}" for n, t in others if t.device != device)
            _fail(ValueError, name, f"every tensor on q's device {device}", odd)

    if scale is None:
        return float(K**-0.5), bound
    return _finite_float("scale", scale, "a new value recompiles a compiled graph"), bound


def _finite_float(name: str, value: object, why: str) -> float:
    """``value`` as a finite Python float: a TypeError naming ``name`` for anything but a real Python number (a
    bool or a tensor included), a ValueError for one that is not finite as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(TypeError, name, f"a finite Python float ({why})", type(value).__name__)
    try:
        f = float(value)
    except OverflowError:
        _fail(ValueError, name, f"a finite Python float ({why})", "an int too large for a float")
    if not math.isfinite(f):
        _fail(ValueError, name, f"a finite Python float ({why})", repr(f))
    return f


def _check_cu_seqlens_values(cu_seqlens: Tensor, T: int) -> None:
    """Values of a CPU ``cu_seqlens`` (reading a CPU tensor does not synchronise with any device)."""
    cu = cu_seqlens.tolist()  # sync-ok: CPU tensor, eager only
    if cu[0] != 0:
        _fail(ValueError, "cu_seqlens", "cu_seqlens[0] == 0", cu[0])
    if cu[-1] != T:
        _fail(ValueError, "cu_seqlens", f"cu_seqlens[-1] == T = {T}", cu[-1])
    if any(b < a for a, b in zip(cu, cu[1:])):
        _fail(ValueError, "cu_seqlens", "non-decreasing values", cu)


def _run(
    entry: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    lower_bound: float | Tensor | None,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    *extra: bool,
) -> tuple[Tensor, ...]:
    s, bound = check_call(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        state_v_first=state_v_first, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
    )  # fmt: skip
    if checks.active(g):
        checks.check_gate_and_beta(g, beta, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    o, final, *states = entry(
        q, k, v, g, beta, s, initial_state, cu_seqlens, A_log, dt_bias, bound, output_final_state,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, *extra,
        state_v_first=state_v_first,
    )  # fmt: skip
    return (o, final if output_final_state else None, *states)


_DOC_ARGS = """
    Args:
        q, k: ``[B, T, H, K]``, float16 / bfloat16 / float32 (float64 for checks), ``K <= 256``.
        v: ``[B, T, HV, V]``, the dtype of q, ``HV`` a multiple of ``H`` (value head ``hv`` reads q/k head
            ``hv // (HV // H)``), ``V <= 256``.
        g: ``[B, T, HV, K]``, log decay (``<= 0``), or the raw gate input with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` in ``[0, 1]``, or logits with ``use_beta_sigmoid_in_kernel``.
        scale: multiplies q; default ``K ** -0.5``. A Python float: a new value recompiles a compiled graph.
        initial_state: ``[N, HV, K, V]`` (float32), N = B, or ``len(cu_seqlens) - 1``; ``[N, HV, V, K]`` with
            ``state_v_first``.
        output_final_state: also return the state after the last token, ``[N, HV, K, V]`` float32 (``[N, HV, V,
            K]`` with ``state_v_first``).
        cu_seqlens: ``[N + 1]`` int32/int64 prefix sums of packed sequences (then B = 1); ``cu_seqlens[0] == 0``,
            non-decreasing, last == T. Values are not read on a GPU: they are the caller's contract.
        use_qk_l2norm_in_kernel: normalise q and k: ``x / sqrt(sum(x * x) + 1e-6)``.
        use_gate_in_kernel: ``g = -exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
            ``g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may be None then).
        A_log: ``[HV]``; dt_bias: ``[HV * K]`` (optional); lower_bound: a float ``<= 0`` (optional; a 0-dim CPU
            tensor is read in eager mode; 0 means no decay).
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)``.
        allow_neg_eigval: beta times 2 (after the sigmoid, if any), so the write can flip a direction.
        state_v_first: every state in and out (and its gradient) in the V-first layout ``[N, HV, V, K]``, the
            layout of vLLM's and SGLang's state pools; the kernels read and write it as it is (no transposed copy).
            Default False: ``[N, HV, K, V]``. The results are the same numbers, transposed.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state ``[N, HV, K, V]`` (``[N, HV, V, K]``
        with ``state_v_first``) float32 or None.

    Raises:
        TypeError, ValueError: naming the argument that breaks the contract (the flags must be bools).
"""


@overload
def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    recompute_in_backward: bool = False,
    return_intermediate_states: Literal[False] = False,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor | None]: ...


@overload
def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    recompute_in_backward: bool = False,
    return_intermediate_states: Literal[True],
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]: ...


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    recompute_in_backward: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    want_states = _flag("return_intermediate_states", return_intermediate_states)
    if want_states and ops.trains(q, k, v, g, beta, initial_state, A_log, dt_bias):
        raise ValueError(
            "return_intermediate_states: the per-chunk states are for inference (prefix caching) and carry no "
            "gradient; call under torch.no_grad() or torch.inference_mode()"
        )
    o, final, *states = _run(
        ops.run_chunk, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, state_v_first, _flag("recompute_in_backward", recompute_in_backward),
        want_states,
    )  # fmt: skip
    return (o, final, states[0]) if return_intermediate_states else (o, final)


def recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor | None]:
    o, final = _run(
        ops.run_recurrent, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, state_v_first,
    )  # fmt: skip
    return o, final


def _validate_pool(
    q: Tensor,
    v: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor | None,
    state_v_first: bool,
    num_accepted_tokens: Tensor | None = None,
    per_token: bool = True,
) -> None:
    """Check the serving step's pool, slot indices and accepted counts (after :func:`_validate` checked the
    rest); ``per_token``: the step takes a slot per token (``[N, T_spec]``) as well as one per sequence."""
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    N = num_sequences(q, cu_seqlens)
    check_float("state_pool", state_pool)
    slot = state_shape(1, HV, K, V, state_v_first)[1:]
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != slot:
        dims = ", ".join(("HV", "V", "K") if state_v_first else ("HV", "K", "V"))
        _fail(ValueError, "state_pool", f"shape {_layout('S', state_v_first)} with {dims} = "
              f"{', '.join(map(str, slot))}", list(state_pool.shape))  # fmt: skip
    if state_pool.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        _fail(TypeError, "state_pool", "a float32 or bfloat16 tensor (float64 for checks)", state_pool.dtype)
    if not state_pool.is_contiguous():
        _fail(ValueError, "state_pool", "a contiguous tensor (it is updated in place; a copy would not be)", "strides "
              f"{state_pool.stride()}")  # fmt: skip
    check_indices("state_indices", state_indices)
    if state_indices.dim() == 2 and per_token:
        if state_indices.shape[0] != N or state_indices.shape[1] == 0:
            _fail(ValueError, "state_indices", f"[N] or [N, T_spec] with N = {N} and T_spec >= 1",
                  list(state_indices.shape))  # fmt: skip
        if cu_seqlens is None and q.shape[1] > state_indices.shape[1]:
            _fail(ValueError, "state_indices", f"[N, T_spec] with T_spec >= T = {q.shape[1]} (a slot per token)",
                  list(state_indices.shape))  # fmt: skip
    else:
        what = "[N] (one slot per sequence)" + (" or [N, T_spec]" if per_token else "")
        _check_shape("state_indices", state_indices, (N,), what)
    tensors = [("state_pool", state_pool), ("state_indices", state_indices)]
    if num_accepted_tokens is not None:
        check_indices("num_accepted_tokens", num_accepted_tokens)
        if state_indices.dim() != 2:
            _fail(ValueError, "num_accepted_tokens", "None unless state_indices is [N, T_spec]", "a tensor")
        _check_shape("num_accepted_tokens", num_accepted_tokens, (N,), "[N] (accepted tokens per sequence)")
        tensors.append(("num_accepted_tokens", num_accepted_tokens))
    for name, x in tensors:
        if x.device != q.device:
            _fail(ValueError, name, f"a tensor on q's device {q.device}", x.device)
    on_cpu = state_indices.device.type == "cpu" and not torch.compiler.is_compiling()
    if on_cpu or checks.active(state_indices):
        check_slot_range(state_indices, state_pool.shape[0])
        idx = state_indices.flatten().tolist()  # sync-ok: a CPU tensor in eager mode, or the checked mode
        used = [i for i in idx if i >= 0]
        if len(set(used)) != len(used):
            _fail(ValueError, "state_indices", "distinct slots (two writes cannot share one state)",
                  state_indices.tolist())  # fmt: skip  # sync-ok: as above
        if num_accepted_tokens is not None:
            acc = num_accepted_tokens.tolist()  # sync-ok: as above
            W = state_indices.shape[1]
            if any(a < 1 or a > W for a in acc):
                _fail(ValueError, "num_accepted_tokens", f"counts in [1, T_spec = {W}]", acc)


def _validate_serving(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float | None,
    cu_seqlens: Tensor | None,
    use_gate_in_kernel: bool,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    lower_bound: float | Tensor | None,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    num_accepted_tokens: Tensor | None,
    per_token: bool,
) -> tuple[float, float | None]:
    """The checks both serving steps share (after their flags): the inputs, the pool and its slots, and in the
    checked mode the gate and beta; the scale and lower bound to use."""
    s, bound = _validate(q, k, v, g, beta, scale, None, cu_seqlens, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    _validate_pool(q, v, state_pool, state_indices, cu_seqlens, state_v_first, num_accepted_tokens, per_token)
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_pool", state_pool),
                        ("A_log", A_log), ("dt_bias", dt_bias)):  # fmt: skip
            if x is not None and x.requires_grad:
                _fail(ValueError, name, "no tensor that requires grad: the serving steps update their pool in place "
                      "and are not differentiable (call them under torch.no_grad() or torch.inference_mode(), or "
                      "detach the inputs)", "a tensor with requires_grad=True")  # fmt: skip
    if checks.active(g):
        checks.check_gate_and_beta(g, beta, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return s, bound


def recurrent_kda_update_(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    num_accepted_tokens: Tensor | None = None,
    write_states: bool = True,
) -> Tensor:
    """The serving step: KDA token by token, from and back into a pool of states, in place. Not differentiable.

    Sequence ``n`` starts from ``state_pool[state_indices[n]]``; its state after its last token is written back
    there. A slot of -1 marks a padding sequence: it is skipped, its output rows are zeros and the pool is left
    alone. One token per sequence is a decode step; several (through ``cu_seqlens``, or a dense ``[B, T]``
    batch) serve chunked prefill or speculative steps. No host synchronisation: capturable in a CUDA graph and
    traceable by ``torch.compile(fullgraph=True)``, which updates the pool in place (no copy).

    Args:
        q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
            lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval: as in :func:`recurrent_kda`.
        state_pool: ``[S, HV, K, V]`` float32 or bfloat16 (float64 for checks), contiguous; updated in place.
            ``[S, HV, V, K]`` with ``state_v_first`` (the layout of vLLM's and SGLang's pools), read and written in
            that layout, in place: no transposed copy. A bfloat16 pool holds half the bytes: each step reads its
            slots into float32, runs in float32 and rounds each state once as it stores it.
        state_indices: ``[N]`` int32/int64, one slot per sequence (N = B, or ``len(cu_seqlens) - 1``), or
            ``[N, T_spec]`` (a slot per draft token: see ``num_accepted_tokens``); distinct except for -1
            (padding). Values are checked only on the CPU in eager mode; on a GPU they are the
            caller's contract (any slot outside ``[0, S)`` is treated as padding; repeated slots race).
        state_v_first: the pool's layout, ``[S, HV, V, K]`` (True) or ``[S, HV, K, V]`` (False, the default).
        num_accepted_tokens: ``[N]`` int32/int64, only with ``state_indices [N, T_spec]`` (speculative decoding):
            sequence ``n`` starts from slot ``state_indices[n, num_accepted_tokens[n] - 1]``, the state after the
            draft tokens the previous step accepted; without it from ``state_indices[n, 0]``. With 2-D indices the
            state after the ``t``-th token of sequence ``n`` is written to slot ``state_indices[n, t]`` (-1: not
            written); tokens past column ``T_spec - 1`` of a packed sequence write nothing (a dense batch needs
            ``T_spec >= T``). A first slot of -1 makes the sequence padding. Counts are checked in ``[1, T_spec]``
            on the CPU in eager mode (``ValueError``); on a GPU a count outside it makes the sequence padding.
        write_states: False: read the pool and write no state at all (a verify step whose outputs alone are kept).

    Returns:
        o: ``[B, T, HV, V]`` in v's dtype.

    Raises:
        TypeError, ValueError: naming the argument that breaks the contract.
    """
    check_flags(
        ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel), ("use_gate_in_kernel", use_gate_in_kernel),
        ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel), ("allow_neg_eigval", allow_neg_eigval),
        ("state_v_first", state_v_first), ("write_states", write_states),
    )  # fmt: skip
    s, bound = _validate_serving(q, k, v, g, beta, state_pool, state_indices, scale, cu_seqlens, use_gate_in_kernel,
                                 A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                 state_v_first, num_accepted_tokens, per_token=True)  # fmt: skip
    return ops.run_update(
        q, k, v, g, beta, state_pool, state_indices, s, cu_seqlens, A_log, dt_bias, bound, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, num_accepted_tokens,
        write_states,
    )  # fmt: skip


def chunk_kda_update_(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    checkpoint_every: int | None = None,
    checkpoint_indices: Tensor | None = None,
) -> Tensor:
    """Chunked prefill into a pool of states: :func:`chunk_kda` from each sequence's slot, its final state written
    back into that slot, in place (no gather or scatter copy of the states). Not differentiable.

    The arguments and the slot contract are those of :func:`recurrent_kda_update_` with one slot per sequence
    (``state_indices [N]``; -1: padding, its output rows zero, the pool untouched): the same step by the chunkwise
    schedule, for prompts long enough that chunks pay (a few hundred tokens and up). Capturable in a CUDA graph
    and traceable by ``torch.compile(fullgraph=True)``, which updates the pool in place.

    Args:
        checkpoint_every: with ``checkpoint_indices``, a positive multiple of 64 (the chunk size): prefix
            checkpoints every that many tokens.
        checkpoint_indices: ``[N, C]`` int32/int64 (optional): the state after ``(m + 1) * checkpoint_every``
            tokens of sequence ``n`` is also written to slot ``checkpoint_indices[n, m]`` (-1: not written; a
            checkpoint past the sequence's end is not written), so a prefix cache can resume from it. The slots
            must differ from each other and from ``state_indices``'s.

    Returns:
        o: ``[B, T, HV, V]`` in v's dtype.

    Raises:
        TypeError, ValueError: naming the argument that breaks the contract.
    """
    check_flags(
        ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel), ("use_gate_in_kernel", use_gate_in_kernel),
        ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel), ("allow_neg_eigval", allow_neg_eigval),
        ("state_v_first", state_v_first),
    )  # fmt: skip
    s, bound = _validate_serving(q, k, v, g, beta, state_pool, state_indices, scale, cu_seqlens, use_gate_in_kernel,
                                 A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                 state_v_first, None, per_token=False)  # fmt: skip
    every = _checkpoints(q, state_pool, state_indices, checkpoint_every, checkpoint_indices)
    return ops.run_chunk_update(
        q, k, v, g, beta, state_pool, state_indices, s, cu_seqlens, A_log, dt_bias, bound, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, every, checkpoint_indices,
    )  # fmt: skip


def _checkpoints(
    q: Tensor, state_pool: Tensor, state_indices: Tensor, every: int | None, idx: Tensor | None
) -> int:
    """Check the prefix checkpoints of :func:`chunk_kda_update_`; their spacing as the op's argument (0: none)."""
    if idx is None:
        if every is not None:
            _fail(ValueError, "checkpoint_every", "None without checkpoint_indices", every)
        return 0
    check_indices("checkpoint_indices", idx)
    N = state_indices.shape[0]
    if idx.dim() != 2 or idx.shape[0] != N:
        _fail(ValueError, "checkpoint_indices", f"[N, C] with N = {N}", list(idx.shape))
    if idx.device != q.device:
        _fail(ValueError, "checkpoint_indices", f"a tensor on q's device {q.device}", idx.device)
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0 or every % CHUNK_SIZE:
        _fail(ValueError, "checkpoint_every", f"a positive multiple of {CHUNK_SIZE} (the chunk size)", every)
    if (idx.device.type == "cpu" and not torch.compiler.is_compiling()) or checks.active(idx):
        used = [i for i in idx.flatten().tolist() + state_indices.tolist() if i >= 0]  # sync-ok: as for the slots
        S = state_pool.shape[0]
        if any(i >= S for i in used) or any(i < -1 for i in idx.flatten().tolist()):  # sync-ok: as above
            _fail(ValueError, "checkpoint_indices", f"slots in [0, {S}) or -1", idx.tolist())  # sync-ok: as above
        if len(set(used)) != len(used):
            _fail(ValueError, "checkpoint_indices", "slots distinct from each other and from state_indices",
                  idx.tolist())  # fmt: skip  # sync-ok: as above
    assert every is not None
    return every


def kda_gate(
    g: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The KDA gate alone: the log decay that ``use_gate_in_kernel`` computes inside both schedules, so it can be
    computed once and passed as ``g`` to :func:`chunk_kda` and :func:`recurrent_kda`. Differentiable in ``g``,
    ``A_log`` and ``dt_bias``; ``torch.ops.kda.gate``.

    ``-exp(A_log) * softplus(g + dt_bias)``; with ``lower_bound``: ``lower_bound * sigmoid(exp(A_log) * (g +
    dt_bias))``, and without ``A_log`` then ``lower_bound * sigmoid(g + dt_bias)``. Computed in float32 (float64
    where an input is float64).

    Args:
        g: ``[..., H, K]`` (``[B, T, H, K]``, or ``[T, H, K]`` for packed rows), any float dtype: the raw input.
        A_log: ``[H]``; may be None only with ``lower_bound``.
        dt_bias: ``[H * K]`` (optional), added to ``g`` per head and channel.
        lower_bound: a finite float (optional): the sigmoid form, with values in ``(lower_bound, 0)`` for a
            negative bound.
        output_dtype: the dtype of the result (default float32).

    Returns:
        The log decay, shaped like ``g``, in ``output_dtype``; its gradients to ``g``, ``A_log`` and ``dt_bias``
        come in their dtypes.

    Raises:
        TypeError, ValueError: naming the argument that breaks the contract.
    """
    check_float("g", g)
    if g.dim() < 2:
        _fail(ValueError, "g", "a tensor [..., H, K] of at least 2 dimensions", f"shape {list(g.shape)}")
    H, K = g.shape[-2], g.shape[-1]
    given: list[tuple[str, Tensor]] = []
    if A_log is None:
        if lower_bound is None:
            _fail(ValueError, "A_log", f"a tensor [H] = [{H}] (it may be None only with a lower_bound)", None)
    else:
        check_float("A_log", A_log)
        _check_shape("A_log", A_log, (H,), "[H] (H from g [..., H, K])")
        given.append(("A_log", A_log))
    if dt_bias is not None:
        check_float("dt_bias", dt_bias)
        _check_shape("dt_bias", dt_bias, (H * K,), "[H * K] (H, K from g [..., H, K])")
        given.append(("dt_bias", dt_bias))
    bound = None if lower_bound is None else check_lower_bound(lower_bound)
    if not isinstance(output_dtype, torch.dtype) or output_dtype not in _FLOAT:
        _fail(TypeError, "output_dtype", "a floating-point torch.dtype", output_dtype)
    for name, x in given:
        if x.device != g.device:
            _fail(ValueError, name, f"a tensor on g's device {g.device}", x.device)
    y: Tensor = ops.gate(g, A_log, dt_bias, bound, output_dtype)
    return y


chunk_kda.__doc__ = (
    "KDA over whole sequences by the chunkwise schedule (training, prefill). Differentiable.\n"
    + _DOC_ARGS.replace(
        "\n    Returns:",
        """        recompute_in_backward: where autograd records the call, keep only the inputs and recompute the
            per-chunk factors in the backward (~2.2 GB less held per layer at T = 32k, H = 32, K = V = 128, for
            ~2.9 ms more backward on an H200). Default False: the forward keeps them (``torch.ops.kda.chunk_train``;
            the Triton kernels only, elsewhere the call recomputes anyway).
        return_intermediate_states: also return the state entering each chunk of 64 tokens (for prefix caching;
            not under autograd): ``[B, cdiv(T, 64), HV, K, V]``, or with ``cu_seqlens`` ``[1, cdiv(T, 64) + N,
            HV, K, V]``: sequence ``n``'s chunks from its chunk offset ``sum_{m<n} cdiv(len_m, 64)``, the slots past
            the last chunk zero (a static shape: no host sync). In v's dtype for 16-bit inputs, else float32.
            ``[..., HV, V, K]`` with ``state_v_first``: a transposed copy of the kernels' per-chunk states,
            which they keep ``[K, V]``.

    Returns:""",
    )
)
recurrent_kda.__doc__ = (
    "KDA token by token by the fused recurrent schedule (decode, short sequences). Differentiable.\n" + _DOC_ARGS
)

__all__ = ["chunk_kda", "chunk_kda_update_", "kda_gate", "recurrent_kda", "recurrent_kda_update_"]
