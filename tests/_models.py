"""A tiny KDA language model shared by the CPU and GPU model tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kda_ops.nn import KDALayer


class TinyKDAModel(nn.Module):
    """Embedding, ``layers`` pre-norm residual KDA blocks, a final norm and an output head."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 2, head_dim: int = 16, layers: int = 2,
                 v_heads: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(layers))
        self.layers = nn.ModuleList(KDALayer(hidden, heads, head_dim, num_v_heads=v_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: Tensor, states: list[Tensor] | None = None, cu_seqlens: Tensor | None = None,
                recurrent: bool = False) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
        """Logits and the final state of each layer."""
        x = self.embed(tokens)
        out_states = []
        for i, (norm, layer) in enumerate(zip(self.norms, self.layers)):
            y, s = layer(norm(x), initial_state=None if states is None else states[i], output_final_state=True,
                         cu_seqlens=cu_seqlens, recurrent=recurrent)  # fmt: skip
            assert s is not None
            out_states.append(s)
            x = x + y
        return self.head(self.norm(x)), out_states


def lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Next-token cross entropy."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def copy_task(batch: int, T: int, vocab: int, device: str | torch.device, seed: int) -> Tensor:
    """Sequences that repeat their first half: learnable by a recurrent memory."""
    gen = torch.Generator().manual_seed(seed)
    half = torch.randint(0, vocab, (batch, T // 2), generator=gen)
    return torch.cat([half, half], dim=1).to(device)


# A two-layer transformers Kimi Linear model (one KDA layer of two heads, one attention layer, dense MLPs), tiny.
KIMI_LINEAR_TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=16, linear_num_heads=2, linear_head_dim=16, layer_types=["linear_attention", "full_attention"],
    mlp_layer_types=["dense", "dense"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def kimi_linear_model(**sizes: Any) -> Any:
    """transformers' ``KimiLinearForCausalLM`` of :data:`KIMI_LINEAR_TINY` with ``sizes`` replaced, seeded weights,
    in eval mode (transformers imported here: the package does not depend on it)."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

    torch.manual_seed(0)
    return KimiLinearForCausalLM(KimiLinearConfig(**{**KIMI_LINEAR_TINY, **sizes})).eval()
