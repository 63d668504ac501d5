"""KDA attention layers built on the public functions.

:class:`KDALayer`: projections, in-kernel gate and beta, output gate and norm. :class:`KimiDeltaAttention`: the
Kimi Linear layer as transformers defines it (short convolution, low-rank forget and output gates, gated RMSNorm),
whose ``state_dict`` loads from transformers' ``KimiLinearDeltaAttention`` as it is. Both call
:func:`kda_ops.chunk_kda` (training, prefill) or :func:`kda_ops.recurrent_kda` (decode), so they compile with
``torch.compile(fullgraph=True)``, export with ``torch.export`` and capture in CUDA graphs.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx._pytree
import torch.nn.functional as F
from torch import Tensor, nn

from kda_ops import checks
from kda_ops.api import (
    MAX_HEAD_DIM,
    check_cu_seqlens_form,
    check_flags,
    check_float,
    check_indices,
    check_lower_bound,
    check_slot_range,
    chunk_kda,
    chunk_kda_update_,
    kda_gate,
    recurrent_kda,
    recurrent_kda_update_,
)


def _check_sizes(sizes: dict[str, int], head_dims: tuple[str, ...], norm_eps: float,
                 lower_bound: object) -> None:  # fmt: skip
    """A layer's constructor arguments: positive int sizes (head dimensions at most the kernels' 256), a positive
    finite ``norm_eps`` and a valid gate bound, or an error naming the argument."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected a positive int, got {type(value).__name__}")
        top = MAX_HEAD_DIM if name in head_dims else None
        if value < 1 or (top is not None and value > top):
            raise ValueError(f"{name}: expected an int in [1, {top or 'inf'}], got {value}")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)):
        raise TypeError(f"norm_eps: expected a finite float > 0, got {type(norm_eps).__name__}")
    if not 0 < norm_eps < math.inf:
        raise ValueError(f"norm_eps: expected a finite float > 0, got {norm_eps!r}")
    if lower_bound is not None:
        check_lower_bound(lower_bound)


def _check_hidden(name: str, x: Tensor, hidden_size: int) -> Tensor:
    """``x``: a floating-point ``[B, T, hidden_size]`` tensor, or an error naming it."""
    check_float(name, x)
    if x.dim() != 3 or x.shape[2] != hidden_size:
        raise ValueError(f"{name}: expected [B, T, hidden_size] with hidden_size = {hidden_size}, got {list(x.shape)}")
    return x


class KDALayer(nn.Module):
    """Kimi Delta Attention over ``x [B, T, hidden_size]``.

    q, k: ``num_heads`` heads of ``head_dim`` (l2-normalised in the kernel); v: ``num_v_heads`` heads of
    ``head_v_dim``. The log decay is ``-exp(A_log) * softplus(f + dt_bias)`` from a projection ``f`` (or
    ``lower_bound * sigmoid(...)`` with ``lower_bound``), beta is ``sigmoid`` of a projection, both computed in the
    kernel. The output of each value head is RMS-normalised, gated by ``sigmoid`` of a projection, and projected
    back to ``hidden_size``. ``recompute_in_backward`` is :func:`kda_ops.chunk_kda`'s: keep only the inputs for the
    backward instead of the per-chunk factors (less memory per layer, a slower backward).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        num_v_heads: int | None = None,
        head_v_dim: int | None = None,
        lower_bound: float | Tensor | None = None,
        norm_eps: float = 1e-5,
        recompute_in_backward: bool = False,
    ) -> None:
        check_flags(("recompute_in_backward", recompute_in_backward))
        sizes = {"hidden_size": hidden_size, "num_heads": num_heads, "head_dim": head_dim,
                 "num_v_heads": num_heads if num_v_heads is None else num_v_heads,
                 "head_v_dim": head_dim if head_v_dim is None else head_v_dim}  # fmt: skip
        _check_sizes(sizes, ("head_dim", "head_v_dim"), norm_eps, lower_bound)
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_v_heads = sizes["num_v_heads"]
        self.head_v_dim = sizes["head_v_dim"]
        if self.num_v_heads % num_heads:
            raise ValueError(f"num_v_heads: expected a multiple of num_heads = {num_heads}, got {self.num_v_heads}")
        self.lower_bound = lower_bound
        self.recompute_in_backward = recompute_in_backward  # chunk_kda's memory/time trade (docs/compile.md)
        HV, K, V = self.num_v_heads, head_dim, self.head_v_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * K, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_heads * K, bias=False)
        self.v_proj = nn.Linear(hidden_size, HV * V, bias=False)
        self.f_proj = nn.Linear(hidden_size, HV * K, bias=False)
        self.b_proj = nn.Linear(hidden_size, HV, bias=False)
        self.g_proj = nn.Linear(hidden_size, HV * V, bias=False)
        self.o_proj = nn.Linear(HV * V, hidden_size, bias=False)
        # decay rates spread over [1, 16] so heads forget at different speeds
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, HV)))
        # softplus(dt_bias) spread log-uniformly over [1e-3, 1e-1]
        dt = torch.exp(torch.rand(HV * K) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.o_norm = nn.RMSNorm(V, eps=norm_eps)

    def forward(
        self,
        x: Tensor,
        *,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: Tensor | None = None,
        recurrent: bool = False,
        state_v_first: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``x [B, T, hidden]`` to ``(y [B, T, hidden], final_state or None)``.

        ``recurrent`` picks the decode schedule (:func:`kda_ops.recurrent_kda`) instead of the chunkwise one;
        ``state_v_first``: ``initial_state`` and the final state ``[N, HV, V, K]`` instead of ``[N, HV, K, V]``.
        """
        check_flags(("recurrent", recurrent))  # output_final_state: checked by the function called
        B, T, _ = _check_hidden("x", x, self.hidden_size).shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        q = self.q_proj(x).view(B, T, H, K)
        k = self.k_proj(x).view(B, T, H, K)
        v = self.v_proj(x).view(B, T, HV, V)
        f = self.f_proj(x).view(B, T, HV, K).float()
        b = self.b_proj(x).view(B, T, HV).float()
        chunk = functools.partial(chunk_kda, recompute_in_backward=self.recompute_in_backward)
        kda = recurrent_kda if recurrent else chunk
        o, state = kda(
            q, k, v, f, b,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            lower_bound=self.lower_bound,
            use_beta_sigmoid_in_kernel=True,
            state_v_first=state_v_first,
        )  # fmt: skip
        gate = torch.sigmoid(self.g_proj(x).view(B, T, HV, V))
        o = self.o_norm(o) * gate
        return self.o_proj(o.reshape(B, T, HV * V)), state


# The transformers releases whose KimiLinearDeltaAttention this layer reproduces (parameter names and shapes, and the
# function), each checked by tests/test_kimi_linear.py against that release's own layer.
TRANSFORMERS_RELEASES = ("5.17.",)


@dataclass(frozen=True)
class KimiState:
    """What :class:`KimiDeltaAttention` carries from one call to the next, per sequence: ``conv [N, 3 * H * K,
    conv_size - 1]``, the last inputs of the short convolution (q, k, v channels), and ``recurrent [N, H, K, V]``,
    the KDA state (fp32)."""

    conv: Tensor
    recurrent: Tensor


# a pytree node, so that torch.export takes and returns it (the layer's state with use_cache); torch before 2.7 calls
# an exported program with one as input only with fx's flatten spec too
torch.export.register_dataclass(KimiState, serialized_type_name="kda_ops.nn.KimiState")
torch.fx._pytree.register_pytree_flatten_spec(KimiState, lambda state, spec: [state.conv, state.recurrent])


class KimiForgetGate(nn.Module):
    """The forget gate's parameters, named as transformers keeps them: the low-rank projection ``f_b_proj(f_a_proj
    (x))`` and ``dt_bias [H * K]``, ``A_log [1, 1, H, 1]``. The gate itself (``-exp(A_log) * softplus(f +
    dt_bias)``) runs inside the KDA kernels."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))

    def forward(self, x: Tensor) -> Tensor:
        """The gate's raw input ``f`` (before ``dt_bias``), ``[..., H * K]`` in float32."""
        f: Tensor = self.f_b_proj(self.f_a_proj(x))
        return f.float()


def causal_conv(x: Tensor, weight: Tensor, cu: Tensor, conv0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The causal depthwise convolution of the packed token stream ``x [T, C]`` (sequences ``cu [N + 1]``, int64)
    with ``weight [C, W + 1]`` (tap ``j`` multiplies the input ``W - j`` tokens back), each sequence starting from
    its ``conv0 [N, C, W]`` (its last ``W`` inputs before, oldest first; None: zeros): the outputs ``[T, C]`` (no
    activation) and each sequence's last ``W`` inputs after it, ``[N, C, W]``. On the device, no host sync."""
    T, C = x.shape
    W = weight.shape[1] - 1
    N = cu.shape[0] - 1
    if T == 0:  # no tokens: each sequence's last inputs are those it came with
        return x * weight[:, W], x.new_zeros(N, C, W) if conv0 is None else conv0.to(x.dtype, copy=True)
    t = torch.arange(T, device=x.device)
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp_(0, max(N - 1, 0))
    start = cu[seq]
    hist = None if conv0 is None else conv0.transpose(1, 2)  # [N, W, C]

    def back(pos: Tensor, n: Tensor, s: Tensor) -> Tensor:
        """The input at stream position ``pos`` as sequence ``n`` (starting at ``s``) sees it: its own token, or
        from its history (``s - W <= pos``)."""
        own = x[pos.clamp(0, max(T - 1, 0))]
        if hist is None:
            old = torch.zeros_like(own)
        else:
            old = hist[n, (pos - s + W).clamp(0, W - 1)]
        return torch.where((pos >= s)[:, None], own, old)

    out = x * weight[:, W]
    for d in range(1, W + 1):
        out = out + back(t - d, seq, start) * weight[:, W - d]
    n = torch.arange(N, device=x.device)
    end = cu[1:]
    last = torch.stack([back(end - W + i, n, cu[:-1]) for i in range(W)], dim=2)  # [N, C, W]
    return out, last


class KimiGatedNorm(nn.Module):
    """The output norm: RMS-normalise each head's output in float32, scale by ``weight [V]``, gate by
    ``sigmoid(gate)``, cast back (transformers' ``KimiLinearRMSNormGated``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """The KDA layer of Kimi Linear over ``hidden_states [B, T, hidden_size]``, with transformers'
    ``KimiLinearDeltaAttention`` parameters (names, shapes, function), so ``load_state_dict`` of that layer's
    ``state_dict`` works unchanged.

    ``q, k, v`` projections (``num_heads`` heads of ``head_dim``), a causal depthwise convolution of
    ``conv_size`` taps over their concatenation followed by SiLU, the forget gate ``-exp(A_log) * softplus(f +
    dt_bias)`` of a low-rank projection ``f`` (or ``lower_bound * sigmoid(exp(A_log) (f + dt_bias))`` with
    ``lower_bound``), ``beta = sigmoid(b_proj(x))``, KDA with q and k l2-normalised, the gated RMSNorm of each
    head's output by a low-rank projection, and ``o_proj``.

    Prefill and training run :func:`kda_ops.chunk_kda`, a step of one token per sequence with a ``state``
    :func:`kda_ops.recurrent_kda`. Sequences come as a dense batch, as packed rows (``cu_seqlens``, B = 1), or as a
    dense batch with an ``attention_mask [B, T]`` (1 on tokens, 0 on padding, left or right): a padding position
    gets no input, no decay and no write, so the state passes it unchanged.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        conv_size: int = 4,
        norm_eps: float = 1e-5,
        lower_bound: float | None = None,
        recompute_in_backward: bool = False,
    ) -> None:
        check_flags(("recompute_in_backward", recompute_in_backward))
        _check_sizes({"hidden_size": hidden_size, "num_heads": num_heads, "head_dim": head_dim}, ("head_dim",),
                     norm_eps, lower_bound)  # fmt: skip
        if isinstance(conv_size, bool) or not isinstance(conv_size, int):
            raise TypeError(f"conv_size: expected an int >= 2, got {type(conv_size).__name__}")
        if conv_size < 2:  # the convolution's state holds its last conv_size - 1 inputs
            raise ValueError(f"conv_size: expected an int >= 2 (the short convolution's taps), got {conv_size}")
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim, self.conv_size = hidden_size, num_heads, head_dim, conv_size
        self.lower_bound = lower_bound
        self.recompute_in_backward = recompute_in_backward
        qkv = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, qkv, bias=False)
        self.k_proj = nn.Linear(hidden_size, qkv, bias=False)
        self.v_proj = nn.Linear(hidden_size, qkv, bias=False)
        self.conv1d = nn.Conv1d(3 * qkv, 3 * qkv, conv_size, groups=3 * qkv, padding=conv_size - 1, bias=False)
        self.forget_gate = KimiForgetGate(hidden_size, num_heads, head_dim)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, qkv, bias=False)
        self.o_norm = KimiGatedNorm(head_dim, norm_eps)
        self.o_proj = nn.Linear(qkv, hidden_size, bias=False)

    @classmethod
    def from_config(cls, config: Any, layer_idx: int | None = None, **kwargs: Any) -> KimiDeltaAttention:
        """The layer of a transformers ``KimiLinearConfig`` (``hidden_size``, ``linear_num_heads``,
        ``linear_head_dim``, ``linear_conv_kernel_dim``, ``rms_norm_eps``; ``hidden_act`` must be ``silu``).
        ``layer_idx`` is accepted for transformers' signature; ``kwargs`` go to the constructor. Refuses a
        transformers release outside :data:`TRANSFORMERS_RELEASES` when transformers is installed."""
        check_transformers()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"config.hidden_act: only 'silu' (the Kimi Linear convolution's), got {act!r}")
        return cls(config.hidden_size, config.linear_num_heads, config.linear_head_dim,
                   conv_size=config.linear_conv_kernel_dim, norm_eps=config.rms_norm_eps, **kwargs)  # fmt: skip

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        *,
        cu_seqlens: Tensor | None = None,
        state: KimiState | None = None,
        use_cache: bool = False,
    ) -> tuple[Tensor, KimiState | None]:
        """``hidden_states [B, T, hidden]`` to ``(output [B, T, hidden], state or None)``.

        ``state``: each sequence's :class:`KimiState` before this call (N = B, or the number of sequences of
        ``cu_seqlens``); ``use_cache``: return the state after it (returned whenever ``state`` is given). One token
        per sequence with a ``state`` is a decode step (the recurrent schedule).
        """
        check_flags(("use_cache", use_cache))
        x = _check_hidden("hidden_states", hidden_states, self.hidden_size)
        if state is not None and not isinstance(state, KimiState):
            raise TypeError(f"state: expected a KimiState or None, got {type(state).__name__}")
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if attention_mask is not None:
            if not isinstance(attention_mask, Tensor):
                raise TypeError(f"attention_mask: expected a torch.Tensor [B, T] or None, got "
                                f"{type(attention_mask).__name__}")  # fmt: skip
            if cu_seqlens is not None:
                raise ValueError("attention_mask: not with cu_seqlens (packed rows have no padding)")
            _check_device("attention_mask", attention_mask, x)
            if attention_mask.shape != (B, T):
                raise ValueError(f"attention_mask: expected [B, T] = [{B}, {T}], got {list(attention_mask.shape)}")
            keep = attention_mask.to(torch.bool)
            x = x * keep[..., None].to(x.dtype)
        cu = _offsets(x, cu_seqlens)
        N = cu.shape[0] - 1
        if state is not None:
            W = self.conv_size - 1
            _check_state(state, N, 3 * H * K, W, H, K, x)
        need_last = use_cache or state is not None
        q, k, v, f, b, conv_last = self._kda_inputs(x, cu, None if state is None else state.conv,
                                                    packed=cu_seqlens is not None, need_last=need_last)
        gate_args: dict[str, Any] = self._gate_args()
        if attention_mask is not None:  # padding: no decay (g = 0) and no write (beta = 0)
            f = kda_gate(f, self.forget_gate.A_log.view(H), self.forget_gate.dt_bias, self.lower_bound)
            f = f.masked_fill(~keep[..., None, None], 0.0)
            b = b.masked_fill(~keep[..., None], -torch.inf)
            gate_args = dict(use_gate_in_kernel=False)
        step = state is not None and T == 1 and cu_seqlens is None
        kda = recurrent_kda if step else functools.partial(chunk_kda, recompute_in_backward=self.recompute_in_backward)
        o, final = kda(
            q, k, v, f, b,
            initial_state=None if state is None else state.recurrent,
            output_final_state=use_cache or state is not None,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            **gate_args,
        )  # fmt: skip
        y = self._output(x, o)
        if final is None:
            return y, None
        assert conv_last is not None  # need_last
        return y, KimiState(conv=conv_last.to(x.dtype), recurrent=final)

    def forward_pool(
        self,
        hidden_states: Tensor,
        conv_pool: Tensor,
        state_pool: Tensor,
        state_indices: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        state_v_first: bool = False,
    ) -> Tensor:
        """The serving form: ``hidden_states [B, T, hidden]`` to ``output [B, T, hidden]``, with each sequence's
        states in pools updated in place (inference only): ``conv_pool [S, 3 * H * K, conv_size - 1]``, the
        convolution's last inputs, and ``state_pool [S, H, K, V]`` (``[S, H, V, K]`` with ``state_v_first``; fp32
        or bf16, as :func:`kda_ops.recurrent_kda_update_` takes it). Sequence ``n`` (N = B, or the sequences of
        ``cu_seqlens`` with B = 1) lives in slot ``state_indices[n]``, distinct; -1 marks a padding sequence: its
        output rows are zeros and neither pool changes. One token per sequence of a dense batch is a decode step
        (the recurrent schedule), anything else a chunked prefill from the slots' states (the chunkwise one). No
        host synchronisation: capturable in a CUDA graph."""
        with torch.no_grad():  # inference only: the pools are updated in place
            return self._forward_pool(hidden_states, conv_pool, state_pool, state_indices, cu_seqlens, state_v_first)

    def _forward_pool(self, hidden_states: Tensor, conv_pool: Tensor, state_pool: Tensor, state_indices: Tensor,
                      cu_seqlens: Tensor | None, state_v_first: bool) -> Tensor:  # fmt: skip
        x = _check_hidden("hidden_states", hidden_states, self.hidden_size)
        B, T, _ = x.shape
        H, K, W = self.num_heads, self.head_dim, self.conv_size - 1
        cu = _offsets(x, cu_seqlens)
        N = cu.shape[0] - 1
        check_float("conv_pool", conv_pool)
        check_float("state_pool", state_pool)
        check_indices("state_indices", state_indices)
        # on the layer's device, as the serving ops take them: a host tensor's copy would not capture in a graph
        for name, t in (("conv_pool", conv_pool), ("state_pool", state_pool), ("state_indices", state_indices)):
            _check_device(name, t, x)
        if tuple(state_indices.shape) != (N,):
            raise ValueError(f"state_indices: expected [N] = [{N}], got {list(state_indices.shape)}")
        if conv_pool.dim() != 3 or tuple(conv_pool.shape[1:]) != (3 * H * K, W):
            raise ValueError(f"conv_pool: expected [S, 3 * H * K, conv_size - 1] = [S, {3 * H * K}, {W}], "
                             f"got {list(conv_pool.shape)}")  # fmt: skip
        if state_pool.dim() != 4:
            raise ValueError(f"state_pool: expected a 4-D tensor [S, H, K, V], got {list(state_pool.shape)}")
        if conv_pool.shape[0] != state_pool.shape[0]:
            raise ValueError(f"conv_pool: expected as many slots as state_pool ({state_pool.shape[0]}), got "
                             f"{conv_pool.shape[0]}")  # fmt: skip
        # the slots before the convolution's gather from conv_pool (the serving step checks them again, later)
        if (state_indices.device.type == "cpu" and not torch.compiler.is_compiling()) or checks.active(state_indices):
            check_slot_range(state_indices, conv_pool.shape[0])
        idx = state_indices.to(torch.int64)
        q, k, v, f, b, conv_last = self._kda_inputs(x, cu, conv_pool[idx.clamp(min=0)].to(x.dtype),
                                                    packed=cu_seqlens is not None, need_last=True)
        update = recurrent_kda_update_ if T == 1 and cu_seqlens is None else chunk_kda_update_
        o = update(q, k, v, f, b, state_pool, idx, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True, state_v_first=state_v_first, **self._gate_args())  # fmt: skip
        assert conv_last is not None  # need_last
        _write_rows(conv_pool, idx, conv_last.to(conv_pool.dtype))
        return self._output(x, o)

    def _gate_args(self) -> dict[str, Any]:
        """The in-kernel gate's keywords of the KDA calls."""
        return dict(use_gate_in_kernel=True, A_log=self.forget_gate.A_log.view(self.num_heads),
                    dt_bias=self.forget_gate.dt_bias, lower_bound=self.lower_bound)  # fmt: skip

    def _kda_inputs(self, x: Tensor, cu: Tensor, conv0: Tensor | None, *, packed: bool,
                    need_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
        """``q, k, v [B, T, H, K]`` (projected, convolved from ``conv0``, SiLU), the gate's raw input ``f``, beta's
        logits ``b`` (float32), and each sequence's last convolution inputs ``[N, 3 * H * K, conv_size - 1]``
        (None unless ``need_last``, where causal-conv1d runs). The convolution is causal-conv1d's where it is
        installed and can take the call (:func:`conv1d_fn`), else :func:`causal_conv`."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        weight = self.conv1d.weight[:, 0]
        fast = conv1d_fn(qkv)
        # causal-conv1d takes a per-sequence state or returns one only for a dense batch, and sequences of packed
        # rows only without either
        if fast is not None and not (packed and (conv0 is not None or need_last)):
            xt = qkv.transpose(1, 2)  # [B, C, T] with the channels contiguous, the layout its states need
            if packed:
                seq = torch.searchsorted(cu, torch.arange(T, device=x.device), right=True) - 1
                out, conv_last = fast(xt, weight, seq_idx=seq[None].to(torch.int32), activation="silu"), None
            elif need_last or conv0 is not None:
                init = None if conv0 is None else conv0.transpose(1, 2).contiguous().transpose(1, 2)
                out, conv_last = fast(xt, weight, initial_states=init, return_final_states=True, activation="silu")
            else:
                out, conv_last = fast(xt, weight, activation="silu"), None
            q, k, v = out.transpose(1, 2).reshape(B, T, 3, H, K).unbind(2)
        else:
            conv, conv_last = causal_conv(qkv.reshape(B * T, qkv.shape[-1]), weight, cu, conv0)
            q, k, v = F.silu(conv).view(B, T, 3, H, K).unbind(2)
        f = self.forget_gate(x).view(B, T, H, K)
        return q, k, v, f, self.b_proj(x).float(), conv_last

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        """The gated norm of the KDA output ``o [B, T, H, V]`` by the low-rank output gate, then ``o_proj``."""
        B, T, _ = x.shape
        gate = self.g_b_proj(self.g_a_proj(x)).view(B, T, self.num_heads, self.head_dim)
        y: Tensor = self.o_proj(self.o_norm(o, gate).reshape(B, T, self.num_heads * self.head_dim))
        return y


@functools.cache
def _causal_conv1d() -> Any:
    """causal-conv1d's ``causal_conv1d_fn``, or None where the package is not installed (it is never required)."""
    try:
        module = importlib.import_module("causal_conv1d")
    except ImportError:
        return None
    return getattr(module, "causal_conv1d_fn", None)


def conv1d_fn(x: Tensor) -> Any:
    """The short convolution's fast path for ``x [B, T, C]``: causal-conv1d's function for CUDA tensors with tokens
    in eager mode when it is installed, else None (:func:`causal_conv` then runs: it passes the states through when
    T = 0; under ``torch.compile`` it traces without a graph break and the compiler fuses it)."""
    if not x.is_cuda or torch.compiler.is_compiling() or x.shape[1] == 0:
        return None
    return _causal_conv1d()


def _offsets(x: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """The sequences' offsets into the flat token stream of ``x [B, T, *]`` (int64 on x's device): ``cu_seqlens``
    (packed rows, B = 1) or one sequence per batch row."""
    B, T = x.shape[0], x.shape[1]
    if cu_seqlens is None:
        return torch.arange(B + 1, device=x.device, dtype=torch.int64) * T
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if B != 1:
        raise ValueError(f"cu_seqlens: packed rows need B = 1, got B = {B}")
    check_cu_seqlens_form(cu_seqlens)  # before the convolution indexes by it (the KDA call checks it again)
    _check_device("cu_seqlens", cu_seqlens, x)
    return cu_seqlens.to(torch.int64)


def _check_device(name: str, t: Tensor, x: Tensor) -> None:
    """``t`` on ``hidden_states``' device, or a ``ValueError`` naming it."""
    if t.device != x.device:
        raise ValueError(f"{name}: expected a tensor on hidden_states' device {x.device}, got {t.device}")


def _write_rows(pool: Tensor, idx: Tensor, rows: Tensor) -> None:
    """``pool[idx[n]] = rows[n]`` in place for every ``idx[n] >= 0`` (distinct), with no host sync: a padding row
    (-1) writes the first real row's value to that row's slot, the same value twice, so the duplicate index leaves
    one result; with no real row each padding row writes slot 0's own value back."""
    if idx.shape[0] == 0:
        return
    real = idx >= 0
    first = real.to(torch.int64).argmax().view(1)
    rows_of = torch.where(real, torch.arange(idx.shape[0], device=idx.device), first)
    target = torch.where(real, idx, idx.index_select(0, first)).clamp(min=0)
    value = torch.where(real.any(), rows[rows_of], pool[target])
    pool.index_copy_(0, target, value)


def _check_state(state: KimiState, N: int, C: int, W: int, H: int, K: int, x: Tensor) -> None:
    """A :class:`KimiState` for ``N`` sequences of this layer on ``x``'s device, or an error naming its part."""
    for name, t in (("state.conv", state.conv), ("state.recurrent", state.recurrent)):
        check_float(name, t)
        _check_device(name, t, x)
    if tuple(state.conv.shape) != (N, C, W):
        raise ValueError(f"state.conv: expected [N, 3 * H * K, conv_size - 1] = [{N}, {C}, {W}], "
                         f"got {list(state.conv.shape)}")  # fmt: skip
    if tuple(state.recurrent.shape) != (N, H, K, K):
        raise ValueError(f"state.recurrent: expected [N, H, K, V] = [{N}, {H}, {K}, {K}], "
                         f"got {list(state.recurrent.shape)}")  # fmt: skip


def check_transformers() -> None:
    """Refuse a transformers release whose Kimi Linear layer this package does not reproduce (nothing when
    transformers is not installed)."""
    try:
        transformers: Any = importlib.import_module("transformers")
    except ImportError:
        return
    version = str(transformers.__version__)
    if not version.startswith(TRANSFORMERS_RELEASES):
        raise NotImplementedError(
            f"transformers {version}: KimiDeltaAttention reproduces the Kimi Linear layer of transformers "
            f"{', '.join(r + 'x' for r in TRANSFORMERS_RELEASES)} only (its parameters were renamed in other releases)"
        )


__all__ = ["KDALayer", "KimiDeltaAttention", "KimiForgetGate", "KimiGatedNorm", "KimiState", "causal_conv"]
