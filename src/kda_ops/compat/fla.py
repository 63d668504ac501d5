"""fla-core's ``fla.ops.kda`` contract (0.6.0) on kda-ops: ``from kda_ops.compat.fla import chunk_kda``.

The three functions take the peer's arguments in its positional order with its defaults (``scale`` is the sixth
argument of ``chunk_kda`` and the eighth of ``fused_recurrent_kda``, after ``A_log`` and ``dt_bias``), and map them
onto :func:`kda_ops.chunk_kda`, :func:`kda_ops.recurrent_kda` and :func:`kda_ops.kda_gate`:

- options that only tune how the peer computes the same function are accepted: ``chunk_size`` (32 or 64),
  ``safe_gate``, ``disable_recompute``, ``cu_seqlens_cpu``, ``use_graph`` and ``max_num_seqs``. kda-ops picks its
  own chunking, keeps the backward's factors (``recompute_in_backward=False``) and needs no host copy of
  ``cu_seqlens`` nor a graph mode (every call is capturable). The peer's checks of these options are kept: a
  ``chunk_size`` other than 32 or 64, ``safe_gate`` with the in-kernel gate and no ``lower_bound`` in ``[-5, 0)``,
  and ``use_graph`` with ``cu_seqlens`` not of ``max_num_seqs + 1`` entries raise ``ValueError``;
- ``state_v_first`` (or its old name ``transpose_state_layout``, with a ``DeprecationWarning``) is kda-ops' own
  ``state_v_first``: states ``[N, HV, V, K]`` in and out;
- options that would change the result and that kda-ops does not have raise ``NotImplementedError`` naming them:
  ``cp_context``; in ``fused_recurrent_kda``
  ``ssm_state_indices`` and ``num_accepted_tokens`` (a pool of states: :func:`kda_ops.recurrent_kda_update_`
  takes them as ``state_indices`` and ``num_accepted_tokens``) and a per-channel ``beta [B, T, HV, V]``;
- ``return_intermediate_states=True`` returns ``(o, final_state, h)``; packed, ``h`` is the peer's ``[1, NT, ...]``
  when ``cu_seqlens_cpu`` is given, else kda-ops' static ``[1, cdiv(T, 64) + N, ...]`` whose first NT are those;
- as in the peer, ``A_log``, ``dt_bias`` and ``lower_bound`` are ignored unless ``use_gate_in_kernel=True``, and
  ``allow_neg_eigval=True`` needs ``use_beta_sigmoid_in_kernel=True`` (``ValueError``); ``A_log`` and ``dt_bias``
  are keyword arguments of ``chunk_kda``. Any other keyword raises ``TypeError`` (the peer drops unknown keywords
  silently; a misspelt option here is an error).

Inputs are ``[B, T, H, K]``. The peer neither detects nor transposes head-first ``[B, H, T, K]`` inputs, and nor
does this module: such a tensor is read as ``[B, T, H, K]``, as the peer reads it. Unlike the peer,
``fused_recurrent_kda`` is differentiable, and every function traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import warnings
from typing import Any, NoReturn

import torch
from torch import Tensor

from kda_ops import api

_CHUNK_SIZES = (32, 64)


def _refuse(option: str, what: str) -> NoReturn:
    raise NotImplementedError(f"{option}: {what} is not implemented in kda-ops")


def _state_v_first(state_v_first: bool, kwargs: dict[str, Any], fn: str) -> bool:
    """``state_v_first``, or its deprecated name ``transpose_state_layout`` (popped from ``kwargs``); a bool, as
    kda-ops' functions check."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError(f"{fn}: pass state_v_first or its deprecated name transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated: it is named state_v_first", DeprecationWarning, 3)
        state_v_first = kwargs.pop("transpose_state_layout")
    return state_v_first


def _no_other_keywords(fn: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise TypeError(f"{fn}() got unexpected keyword arguments {sorted(kwargs)}")


def _check_beta_options(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: expected use_beta_sigmoid_in_kernel=True with it (beta in [0, 2))")


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """``fla.ops.kda.chunk_kda`` on :func:`kda_ops.chunk_kda`; ``(o, final_state or None)``.

    Keywords beyond the signature, as in the peer: ``A_log [HV]`` and ``dt_bias [HV * K]`` (with
    ``use_gate_in_kernel``), ``chunk_size`` (32 or 64, default 64) and ``transpose_state_layout``.
    """
    state_v_first = _state_v_first(state_v_first, kwargs, "chunk_kda")
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", 64)
    _no_other_keywords("chunk_kda", kwargs)
    if cp_context is not None:
        _refuse("cp_context", "context parallelism")
    if chunk_size not in _CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected 32 or 64, got {chunk_size}")
    # the tuning options: checked as the peer would take them, though they change nothing here
    api.check_flags(("safe_gate", safe_gate), ("disable_recompute", disable_recompute), ("use_graph", use_graph))
    if max_num_seqs is not None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int):
            raise TypeError(f"max_num_seqs: expected a positive int or None, got {type(max_num_seqs).__name__}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected a positive int or None, got {max_num_seqs}")
    if cu_seqlens is not None:
        api.check_cu_seqlens_form(cu_seqlens)
    if cu_seqlens_cpu is not None:
        api.check_indices("cu_seqlens_cpu", cu_seqlens_cpu)
        if cu_seqlens is None or cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu: expected a CPU copy of cu_seqlens (shape "
                             f"{None if cu_seqlens is None else list(cu_seqlens.shape)}), got shape "
                             f"{list(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}")  # fmt: skip
        # its values where reading cu_seqlens costs no device sync: a stale copy would cut the intermediate states
        # short
        if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
            if not torch.equal(cu_seqlens_cpu.long(), cu_seqlens.long()):
                want, got = cu_seqlens.tolist(), cu_seqlens_cpu.tolist()  # sync-ok: CPU tensors
                raise ValueError(f"cu_seqlens_cpu: expected the values of cu_seqlens {want}, got {got}")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("lower_bound: expected a float in [-5, 0) with safe_gate and use_gate_in_kernel, got None")
        bound = api.check_lower_bound(lower_bound)
        if not -5 <= bound < 0:
            raise ValueError(f"lower_bound: expected a float in [-5, 0) with safe_gate, got {lower_bound}")
    _check_beta_options(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_graph and cu_seqlens is not None and max_num_seqs is not None and cu_seqlens.shape[0] != max_num_seqs + 1:
        raise ValueError(
            f"cu_seqlens: expected max_num_seqs + 1 = {max_num_seqs + 1} entries with use_graph (pad with empty "
            f"sequences), got {cu_seqlens.shape[0]}"
        )
    if not use_gate_in_kernel:
        A_log = dt_bias = lower_bound = None
    call: dict[str, Any] = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        recompute_in_backward=False, state_v_first=state_v_first,
    )  # fmt: skip
    if not return_intermediate_states:
        return api.chunk_kda(q, k, v, g, beta, **call)
    o, final, h = api.chunk_kda(q, k, v, g, beta, **call, return_intermediate_states=True)
    if cu_seqlens is not None and cu_seqlens_cpu is not None:
        # the peer's [1, NT, ...] with NT the chunks of all sequences, counted on the host copy (no device sync);
        # without it the static [1, cdiv(T, 64) + N, ...] whose first NT are those
        lens = cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]
        h = h[:, : int(((lens + 63) // 64).sum())]
    return o, final, h


def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """``fla.ops.kda.fused_recurrent_kda`` on :func:`kda_ops.recurrent_kda`; ``(o, final_state or None)``.

    ``dt_bias`` is ``[HV * K]``, as the peer's kernel reads it. Keywords beyond the signature:
    ``transpose_state_layout``; ``ssm_state_indices`` and ``num_accepted_tokens`` raise ``NotImplementedError``.
    """
    state_v_first = _state_v_first(state_v_first, kwargs, "fused_recurrent_kda")
    for option in ("ssm_state_indices", "num_accepted_tokens"):
        if kwargs.pop(option, None) is not None:
            _refuse(option, "a state pool read through indices (kda_ops.recurrent_kda_update_ takes them as "
                    "state_indices and num_accepted_tokens)")
    _no_other_keywords("fused_recurrent_kda", kwargs)
    if isinstance(beta, Tensor) and isinstance(v, Tensor) and v.dim() == 4 and beta.shape == v.shape:
        _refuse("beta", "a per-channel beta [B, T, HV, V]")  # any other shape: the ValueError of a wrong one
    _check_beta_options(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if not use_gate_in_kernel:
        A_log = dt_bias = lower_bound = None
    return api.recurrent_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
    )  # fmt: skip


def fused_kda_gate(
    g: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``fla.ops.kda.gate.fused_kda_gate`` on :func:`kda_ops.kda_gate`: ``g [..., H, K]`` to its log decay in
    ``output_dtype``. As in the peer, ``A_log`` may have any shape of ``H`` elements and ``dt_bias`` any of
    ``H * K``; their gradients come in their shapes."""
    if isinstance(g, Tensor) and g.dim() >= 2:
        H, K = g.shape[-2], g.shape[-1]
        if isinstance(A_log, Tensor) and A_log.dim() != 1 and A_log.numel() == H:
            A_log = A_log.reshape(H)
        if isinstance(dt_bias, Tensor) and dt_bias.dim() != 1 and dt_bias.numel() == H * K:
            dt_bias = dt_bias.reshape(H * K)
    return api.kda_gate(g, A_log, dt_bias, lower_bound, output_dtype)


__all__ = ["chunk_kda", "fused_kda_gate", "fused_recurrent_kda"]
