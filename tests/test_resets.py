"""A hard reset, ``g = -inf`` in some key channels of some tokens (how users mark a reset inside a packed row):
outputs, final states and gradients finite and equal to the float64 recurrence, for both schedules, on the
reference, the Triton kernels under the interpreter and on CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda_ops
from kda_ops import ops
from kda_ops.reference.naive import naive_recurrent_kda
from kda_ops.testing import assert_rel

PATHS = [
    pytest.param("reference", id="reference"),
    pytest.param("triton", marks=[pytest.mark.interpret, pytest.mark.slow], id="interpret"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]
CU = [0, 40, 100, 130]  # a reset inside the second sequence and one at the first token of the third


@contextlib.contextmanager
def on(path: str) -> Iterator[torch.device]:
    if path == "cuda":
        yield torch.device("cuda")
        return
    with ops.cpu_backend(path):
        yield torch.device("cpu")


def inputs(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    T, H, K, V = CU[-1], 2, 16, 16
    x = {n: torch.randn(1, T, H, d, generator=gen) for n, d in (("q", K), ("k", K), ("v", V))}
    x["k"] = F.normalize(x["k"], dim=-1)
    x["g"] = F.logsigmoid(torch.randn(1, T, H, K, generator=gen))
    x["g"][0, 60, 0] = -torch.inf  # every channel of head 0
    x["g"][0, 75, 1, 3] = -torch.inf  # one channel of head 1
    x["g"][0, 100, :, :5] = -torch.inf
    x["beta"] = torch.rand(1, T, H, generator=gen)
    return {n: t.to(device, dtype).requires_grad_() for n, t in x.items()}


@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("path", PATHS)
def test_hard_reset(path: str, fn: Callable[..., Any]) -> None:
    with on(path) as device:
        x = inputs(device, torch.float32)
        cu = torch.tensor(CU, device=device)
        o, s = fn(**x, cu_seqlens=cu, output_final_state=True)
        do = torch.randn_like(o)
        torch.autograd.backward((o, s), (do, torch.ones_like(s)))
    r = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o_r, s_r = naive_recurrent_kda(**r, cu_seqlens=cu, output_final_state=True)
    assert s_r is not None
    torch.autograd.backward((o_r, s_r), (do.double(), torch.ones_like(s_r)))
    assert_rel(o, o_r, 1e-5, "o")
    assert_rel(s, s_r, 1e-5, "final state")
    for n, t in x.items():
        assert t.grad is not None and t.grad.isfinite().all(), f"d{n} not finite"
        ref = r[n].grad
        assert ref is not None
        assert_rel(t.grad, ref, 1e-4, f"d{n}")
