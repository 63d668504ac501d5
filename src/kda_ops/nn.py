"""A KDA attention layer built on the public functions: projections, in-kernel gate and beta, output gate and norm.

The layer calls :func:`kda_ops.chunk_kda` (training, prefill) or :func:`kda_ops.recurrent_kda` (decode), so it
compiles with ``torch.compile(fullgraph=True)``, exports with ``torch.export`` and captures in CUDA graphs.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from kda_ops.api import check_flags, chunk_kda, recurrent_kda


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
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_v_heads = num_heads if num_v_heads is None else num_v_heads
        self.head_v_dim = head_dim if head_v_dim is None else head_v_dim
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
        B, T, _ = x.shape
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


__all__ = ["KDALayer"]
