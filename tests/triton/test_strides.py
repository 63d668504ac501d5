"""The ops on inputs that are dense but not contiguous (batch-major tensors transposed, a state transposed in
memory): outputs and every gradient equal to those of the same values laid out contiguously, and the outputs
contiguous, the strides the fake functions give (a compiled graph checks them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import kda_ops
from kda_ops.testing import make_inputs, make_state
from tests.cases import batch_transposed, state_transposed

NAMES = ("q", "k", "v", "g", "beta")


def run(fn: Callable[..., tuple[Tensor, Tensor]], x: dict[str, Tensor], h0: Tensor, do: Tensor, dht: Tensor,
        lay: Callable[[Tensor], Tensor], lay_state: Callable[[Tensor], Tensor]) -> list[Tensor]:  # fmt: skip
    leaves = {n: lay(x[n]).detach().requires_grad_() for n in NAMES}
    s0 = lay_state(h0).detach().requires_grad_()
    o, s = fn(**leaves, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.is_contiguous() and s.is_contiguous()
    torch.autograd.backward([o, s], [do, dht])
    return [o, s, *(leaves[n].grad for n in NAMES), s0.grad]  # type: ignore[list-item]


@pytest.mark.usefixtures("triton_path")
@pytest.mark.parametrize("name", ["recurrent", "chunk"])
def test_non_contiguous_inputs_give_the_contiguous_results(name: str, device: torch.device) -> None:
    fn = kda_ops.recurrent_kda if name == "recurrent" else kda_ops.chunk_kda
    x = make_inputs(2, 70, 2, 16, 16, dtype=torch.float32, device=device, seed=0)
    h0 = make_state(2, 2, 16, 16, device=device)
    gen = torch.Generator(device).manual_seed(3)
    do = torch.randn(2, 70, 2, 16, generator=gen, device=device)
    dht = torch.randn(2, 2, 16, 16, generator=gen, device=device)
    want = run(fn, x, h0, do, dht, lambda t: t, lambda t: t)
    got = run(fn, x, h0, do, dht, batch_transposed, state_transposed)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"result {i}: max difference {(a - b).abs().max().item():.3e}"
