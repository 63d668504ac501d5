"""What the recurrent kernel tests share: inputs of an option, and the Triton path against the float64 oracle
(forward outputs and, with ``grads``, every gradient)."""

from __future__ import annotations

from typing import Any

import torch

import kda_ops
from kda_ops import ops
from kda_ops.reference import naive_recurrent_kda
from kda_ops.testing import assert_rel, rel_err
from tests.cases import F64, double, option_inputs

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def case(name: str, B: int, T: int, H: int, K: int, V: int, HV: int, dtype: torch.dtype,
         seed: int = 0) -> dict[str, Any]:  # fmt: skip
    return option_inputs(name, B, T, H, K, V, HV=HV, dtype=dtype, seed=seed)


def run(
    fn: Any, x: dict[str, Any], h0: torch.Tensor | None, cu: torch.Tensor | None, final: bool, grads: bool,
    do: torch.Tensor, dht: torch.Tensor | None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Outputs of ``fn`` and, with ``grads``, the gradients of ``<o, do> + <final, dht>`` to every tensor input."""
    x = dict(x)
    leaves = {n: t for n, t in x.items() if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if h0 is not None:
        leaves["initial_state"] = h0
    if grads:
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    x.update({n: t for n, t in leaves.items() if n != "initial_state"})
    o, s = fn(**x, initial_state=leaves.get("initial_state"), cu_seqlens=cu, output_final_state=final)
    out = {"o": o}
    if final:
        assert s is not None
        out["final_state"] = s
    if grads:
        loss = (o.double() * do.double()).sum()
        if final and dht is not None:
            loss = loss + (s.double() * dht.double()).sum()
        names = list(leaves)
        for n, gr in zip(names, torch.autograd.grad(loss, [leaves[n] for n in names])):
            out["d" + n] = gr
    return out


def compare(
    x: dict[str, Any], *, h0: torch.Tensor | None = None, cu: torch.Tensor | None = None, final: bool = True,
    grads: bool = False, dht: bool = True, tol: float | None = None,
) -> None:  # fmt: skip
    """The Triton path against the float64 oracle; tolerance ``tol``, or (fp16) twice the reference's error."""
    dtype = x["q"].dtype
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(7), dtype=F64).to(dtype)
    dh = None
    if final and dht:
        B, _, _, K = x["q"].shape
        N = B if cu is None else cu.shape[0] - 1
        dh = torch.randn(N, x["v"].shape[2], K, x["v"].shape[3], generator=torch.Generator().manual_seed(8))
    got = run(kda_ops.recurrent_kda, x, h0, cu, final, grads, do, dh)
    with ops.cpu_backend("reference"):
        oracle = run(naive_recurrent_kda, double(x), None if h0 is None else h0.double(), cu, final, grads, do, dh)
        same_precision = None if tol is not None else run(kda_ops.recurrent_kda, x, h0, cu, final, grads, do, dh)
    assert got.keys() == oracle.keys()
    for n in got:
        if n[1:] in x:  # a gradient has its input's dtype
            assert got[n].dtype == x[n[1:]].dtype, n
        limit = tol if tol is not None else 2 * rel_err(same_precision[n], oracle[n]) + 1e-6  # type: ignore[index]
        assert_rel(got[n], oracle[n], limit, n)
