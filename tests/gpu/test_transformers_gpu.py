"""On the GPU: a transformers Kimi Linear model patched by ``apply_kda_ops`` (skipped where transformers is not
installed). In bf16 its logits are as close to the float64 model's as transformers' own PyTorch path in bf16, and
its greedy tokens are that path's; each patched KDA layer compiles whole (no graph break) and equals its eager run.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kda_ops.testing import rel_err
from tests._models import kimi_linear_model

pytestmark = pytest.mark.gpu
modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
from kda_ops.integrations import transformers as integration  # noqa: E402

NAMES = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
DEV = "cuda"


@pytest.fixture
def torch_path() -> Iterator[None]:
    """transformers' own PyTorch KDA functions during the test (not the kernels it may have bound at import, such as
    fla's), its module-level functions restored after (the patch is process-wide)."""
    saved = {n: getattr(modeling, n) for n in NAMES}
    for n, f in saved.items():
        setattr(modeling, n, inspect.unwrap(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(modeling, n, f)


def kimi(dtype: torch.dtype) -> Any:
    """A two-layer Kimi Linear model (one KDA layer of two 128-wide heads, one attention layer), same weights for
    every dtype."""
    return kimi_linear_model(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                             kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=64,
                             linear_head_dim=128).to(DEV, dtype)  # fmt: skip


def prompt(T: int) -> torch.Tensor:
    return torch.randint(3, 256, (2, T), generator=torch.Generator().manual_seed(1)).to(DEV)


@pytest.mark.usefixtures("torch_path")
def test_bf16_logits_as_close_to_float64_as_transformers() -> None:
    ids = prompt(200)  # three chunks, the last one partial
    with torch.no_grad():
        ref = kimi(torch.float64)(ids).logits
        theirs = kimi(torch.bfloat16)(ids).logits
        model = integration.apply_kda_ops(kimi(torch.bfloat16))
        ours = model(ids).logits
    e_ours, e_theirs = rel_err(ours, ref), rel_err(theirs, ref)
    # bf16 activations bound both paths' error alike; 1.5x leaves room for the order of the sums
    assert e_ours <= 1.5 * e_theirs, f"kda-ops {e_ours:.3e} against transformers' PyTorch path {e_theirs:.3e}"


@pytest.mark.usefixtures("torch_path")
def test_generate_equals_transformers_in_fp32() -> None:
    ids = prompt(70)
    with torch.no_grad():
        theirs = kimi(torch.float32).generate(ids, max_new_tokens=8, do_sample=False)
        model = integration.apply_kda_ops(kimi(torch.float32))
        ours = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, theirs)


@pytest.mark.usefixtures("torch_path")
def test_patched_kda_layer_compiles_whole_and_equals_eager() -> None:
    model = integration.apply_kda_ops(kimi(torch.bfloat16))
    layer = next(m for m in model.modules() if isinstance(m, modeling.KimiLinearDeltaAttention))
    x = torch.randn(2, 200, 256, device=DEV, dtype=torch.bfloat16, generator=torch.Generator(DEV).manual_seed(2))
    torch._dynamo.reset()
    with torch.no_grad():
        explain = torch._dynamo.explain(layer)(x)
        assert explain.graph_break_count == 0, explain.break_reasons
        out = torch.compile(layer, fullgraph=True)(x)
        ref = layer(x)
    out, ref = (y[0] if isinstance(y, tuple) else y for y in (out, ref))
    assert rel_err(out, ref) <= 1e-2
