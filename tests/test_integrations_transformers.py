"""``kda_ops.integrations.transformers.apply_kda_ops``: a transformers Kimi Linear model whose KDA runs through
kda-ops gives the logits and the greedy ``generate()`` tokens of the model as transformers runs it (skipped where
transformers is not installed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kda_ops.testing import assert_rel
from tests._models import kimi_linear_model

modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
from kda_ops.integrations import transformers as integration  # noqa: E402

NAMES = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")


@pytest.fixture
def restored() -> Iterator[None]:
    """transformers' own functions back after the test (the patch is process-wide)."""
    saved = {n: getattr(modeling, n) for n in NAMES}
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(modeling, n, f)


def tiny_model() -> Any:
    return kimi_linear_model()


@pytest.mark.usefixtures("restored")
def test_logits_and_generate_equal_transformers() -> None:
    model = tiny_model()
    ids = torch.randint(3, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert integration.apply_kda_ops(model) is model
        assert integration.apply_kda_ops(model) is model  # idempotent
        assert all(getattr(modeling, n) is getattr(integration, n) for n in NAMES)
        assert_rel(model(ids).logits, logits, 1e-5)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), tokens)


@pytest.mark.usefixtures("restored")
def test_refusals_name_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="no KimiLinearDeltaAttention"):
        integration.apply_kda_ops(torch.nn.Linear(2, 2))
    import transformers

    monkeypatch.setattr(transformers, "__version__", "9.0.0")
    with pytest.raises(NotImplementedError, match="transformers 9.0.0"):
        integration.apply_kda_ops(tiny_model())


@pytest.mark.usefixtures("restored")
def test_gradients_equal_transformers() -> None:
    ids = torch.randint(3, 64, (2, 70), generator=torch.Generator().manual_seed(2))

    def grads() -> dict[str, torch.Tensor]:
        model = tiny_model().train()
        model(ids).logits.square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    theirs = grads()
    integration.apply_kda_ops(tiny_model())
    ours = grads()
    assert ours.keys() == theirs.keys() and any("forget_gate" in n for n in ours)
    for n in ours:
        assert_rel(ours[n], theirs[n], 1e-4, n)
