"""kda-ops under transformers' Kimi Linear: :func:`apply_kda_ops` swaps the KDA kernels of ``KimiLinearForCausalLM``
(or of any module tree holding ``KimiLinearDeltaAttention``) for :func:`kda_ops.chunk_kda` and
:func:`kda_ops.recurrent_kda`, the way Liger-Kernel's ``apply_liger_kernel_to_*`` patch other models.

transformers' layer calls two module-level functions of ``transformers.models.kimi_linear.modeling_kimi_linear``,
``chunk_kimi_delta_attention`` (prefill, training) and ``recurrent_kimi_delta_attention`` (a decode step with its
cache); both are replaced by adapters with their signatures, so the layer's projections, convolution, cache and
``generate()`` stay transformers' own. The patch is process-wide, as Liger's is, and idempotent.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from kda_ops.api import chunk_kda, recurrent_kda
from kda_ops.nn import check_transformers

MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"


def chunk_kimi_delta_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' ``chunk_kimi_delta_attention`` by :func:`kda_ops.chunk_kda` (``[B, T, H, *]`` inputs, the
    states in float32, as the decode step takes them). ``chunk_size`` is how the peer computes, not what: accepted
    and unused; a ``cu_seqlens`` keyword passes on."""
    return chunk_kda(query, key, value, g, beta,
                     initial_state=None if initial_state is None else initial_state.float(),
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     cu_seqlens=kwargs.get("cu_seqlens"))  # fmt: skip


def recurrent_kimi_delta_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' ``recurrent_kimi_delta_attention`` (the decode step) by :func:`kda_ops.recurrent_kda`."""
    return recurrent_kda(query, key, value, g, beta,
                         initial_state=None if initial_state is None else initial_state.float(),
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         cu_seqlens=kwargs.get("cu_seqlens"))  # fmt: skip


def apply_kda_ops(model: nn.Module) -> nn.Module:
    """Run the KDA of every ``KimiLinearDeltaAttention`` in transformers through kda-ops; returns ``model``.

    Raises ImportError without transformers, NotImplementedError for a transformers release whose layer kda-ops
    does not know (:data:`kda_ops.nn.TRANSFORMERS_RELEASES`), ValueError when ``model`` holds no Kimi Linear KDA
    layer."""
    check_transformers()
    import importlib

    modeling: Any = importlib.import_module(MODELING)  # ImportError: transformers missing, or without Kimi Linear
    if not any(isinstance(m, modeling.KimiLinearDeltaAttention) for m in model.modules()):
        raise ValueError(f"model: holds no KimiLinearDeltaAttention ({type(model).__name__})")
    modeling.chunk_kimi_delta_attention = chunk_kimi_delta_attention
    modeling.recurrent_kimi_delta_attention = recurrent_kimi_delta_attention
    return model


__all__ = ["apply_kda_ops", "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"]
