"""The KDA layer on the CPU: both schedules agree, a compiled training step equals eager, export works."""

from __future__ import annotations

import pytest
import torch

from kda_ops.nn import KDALayer
from tests._models import TinyKDAModel, copy_task, lm_loss


def test_layer_schedules_agree_and_carry_state() -> None:
    torch.manual_seed(0)
    layer = KDALayer(32, 2, 8, num_v_heads=4)
    x = torch.randn(2, 12, 32)
    y, s = layer(x, output_final_state=True)
    y2, _ = layer(x, output_final_state=True, recurrent=True)
    torch.testing.assert_close(y, y2, rtol=1e-4, atol=1e-5)
    # prefill of 8 tokens then 4 decode steps equals the whole sequence
    _, s8 = layer(x[:, :8], output_final_state=True)
    outs = []
    for t in range(8, 12):
        yt, s8 = layer(x[:, t : t + 1], initial_state=s8, output_final_state=True, recurrent=True)
        outs.append(yt)
    torch.testing.assert_close(torch.cat(outs, 1), y[:, 8:], rtol=1e-4, atol=1e-5)
    assert s is not None and s8 is not None
    torch.testing.assert_close(s8, s, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiled_training_step_equals_eager_and_learns() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyKDAModel()
    compiled_model = TinyKDAModel()
    compiled_model.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt_c = torch.optim.AdamW(compiled_model.parameters(), lr=3e-3)

    def step(m: TinyKDAModel, o: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(m(tokens)[0], tokens)
        o.zero_grad()
        loss.backward()
        o.step()
        return loss.detach()

    fwd = torch.compile(compiled_model, fullgraph=True)
    losses, losses_c = [], []
    tokens = copy_task(4, 16, 64, "cpu", seed=0)  # one batch, fitted: the loss must fall
    for _ in range(12):
        losses.append(step(model, opt, tokens))
        losses_c.append(step(fwd, opt_c, tokens))  # type: ignore[arg-type]
    torch.testing.assert_close(torch.stack(losses_c), torch.stack(losses), rtol=1e-4, atol=1e-4)
    assert losses[-1] < losses[0]


def test_export_layer() -> None:
    torch.manual_seed(0)
    layer = KDALayer(16, 2, 8)
    x = torch.randn(1, 9, 16)
    ep = torch.export.export(layer, (x,))
    torch.testing.assert_close(ep.module()(x)[0], layer(x)[0])
