"""The standalone gate ``kda_ops.kda_gate`` / ``torch.ops.kda.gate``: the formulas, opcheck, gradcheck, equality
with the in-kernel gate of both schedules (values and gradients), torch.compile, and argument errors."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda_ops
from kda_ops import ops
from kda_ops.testing import make_inputs, make_state, rel_err
from tests.cases import assert_compiles_like_eager

F64 = torch.float64
H, K = 3, 4
# (uses A_log, uses dt_bias, lower_bound): the softplus form, the sigmoid form, and the sigmoid form without A_log
FORMS = {
    "softplus": (True, True, None),
    "softplus, no dt_bias": (True, False, None),
    "sigmoid": (True, True, -5.0),
    "sigmoid, no A_log": (False, True, -3.0),
}


def _params(form: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
    use_a, use_b, lb = FORMS[form]
    A_log = torch.randn(H, dtype=dtype) * 0.5 if use_a else None
    dt_bias = torch.randn(H * K, dtype=dtype) * 0.5 if use_b else None
    return A_log, dt_bias, lb


def _formula(x: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lb: Any) -> torch.Tensor:
    """The gate of ``docs/math.md`` in float64, written out here (not through kda_ops.transforms)."""
    z = x.double()
    if dt_bias is not None:
        z = z + dt_bias.double().view(H, K)
    a = None if A_log is None else A_log.double().exp()[:, None]
    if lb is None:
        assert a is not None
        return -a * F.softplus(z)
    return lb * torch.sigmoid(z if a is None else a * z)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(2, 5, H, K), (7, H, K)], ids=["BTHK", "THK"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_matches_the_formula(form: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(shape) * 3).to(dtype)
    A_log, dt_bias, lb = _params(form)
    y = kda_ops.kda_gate(x, A_log, dt_bias, lb)
    assert y.dtype == torch.float32 and y.shape == x.shape  # float32 by default, whatever g's dtype
    assert rel_err(y, _formula(x, A_log, dt_bias, lb)) <= 1e-6
    assert (y < 0).all()
    y16 = kda_ops.kda_gate(x, A_log, dt_bias, lb, torch.float16)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16, y.half())


def test_gate_of_a_strided_view_is_contiguous() -> None:
    x = torch.randn(5, 2, H, K).transpose(0, 1)
    A_log, dt_bias, lb = _params("softplus")
    y = kda_ops.kda_gate(x, A_log, dt_bias, lb)
    assert y.is_contiguous()
    torch.testing.assert_close(y, kda_ops.kda_gate(x.contiguous(), A_log, dt_bias, lb))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_gate(form: str, requires_grad: bool) -> None:
    x = torch.randn(2, 3, H, K)
    A_log, dt_bias, lb = _params(form)
    if requires_grad:
        x.requires_grad_()
        for t in (A_log, dt_bias):
            if t is not None:
                t.requires_grad_()
    torch.library.opcheck(torch.ops.kda.gate.default, (x, A_log, dt_bias, lb, torch.float32))


@pytest.mark.parametrize("form", FORMS)
def test_opcheck_gate_bwd(form: str) -> None:
    x = torch.randn(2, 3, H, K, dtype=torch.bfloat16)
    A_log, dt_bias, lb = _params(form)
    dy = torch.randn(2, 3, H, K)
    torch.library.opcheck(torch.ops.kda.gate_bwd.default, (dy, x, A_log, dt_bias, lb))


@pytest.mark.parametrize("form", FORMS)
def test_gradcheck_gate(form: str) -> None:
    x = (torch.randn(2, 3, H, K, dtype=F64) * 2).requires_grad_()
    A_log, dt_bias, lb = _params(form, F64)
    leaves = [t.requires_grad_() for t in (x, A_log, dt_bias) if t is not None]

    def f(*args: torch.Tensor) -> torch.Tensor:
        it = iter(args)
        xx = next(it)
        a = next(it) if A_log is not None else None
        b = next(it) if dt_bias is not None else None
        return kda_ops.kda_gate(xx, a, b, lb, F64)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-8)


def test_gradients_come_in_the_inputs_dtypes() -> None:
    x = torch.randn(2, 3, H, K, dtype=torch.bfloat16, requires_grad=True)
    A_log = torch.randn(H, requires_grad=True)
    dt_bias = torch.randn(H * K, dtype=F64, requires_grad=True)
    kda_ops.kda_gate(x, A_log, dt_bias, None).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert A_log.grad is not None and A_log.grad.dtype == torch.float32
    assert dt_bias.grad is not None and dt_bias.grad.dtype == F64


@contextlib.contextmanager
def _backend(name: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(ops.cpu_backend(name))
        if name == "triton":
            from kda_ops.triton.launch import poison_outputs

            stack.enter_context(poison_outputs())
        yield


SCHEDULES = {"chunk": kda_ops.chunk_kda, "recurrent": kda_ops.recurrent_kda}


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "sigmoid"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpret)])
def test_gate_then_schedule_equals_the_in_kernel_gate(lower_bound: float | None, schedule: str, backend: str) -> None:
    """``schedule(g=kda_gate(x))`` and ``schedule(g=x, use_gate_in_kernel=True)``: same output, final state and
    gradients (of x, A_log, dt_bias and the rest), within float32 rounding."""
    fn = SCHEDULES[schedule]
    x = make_inputs(1, 20, 1, 8, 8, HV=2, gate_in_kernel=True)
    cu = torch.tensor([0, 7, 20])
    h0 = make_state(2, 2, 8, 8)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    common: dict[str, Any] = {"initial_state": h0, "output_final_state": True, "cu_seqlens": cu,
                              "use_qk_l2norm_in_kernel": True}  # fmt: skip
    with _backend(backend):
        raw = {n: t.clone().requires_grad_() for n, t in x.items()}
        o1, s1 = fn(**raw, use_gate_in_kernel=True, lower_bound=lower_bound, **common)
        gate_in = {n: t for n, t in leaves.items() if n not in ("A_log", "dt_bias")}
        gate_in["g"] = kda_ops.kda_gate(leaves["g"], leaves["A_log"], leaves["dt_bias"], lower_bound)
        o2, s2 = fn(**gate_in, **common)
        assert s1 is not None and s2 is not None
        assert rel_err(o2, o1) <= 1e-5 and rel_err(s2, s1) <= 1e-5
        do, dht = torch.randn_like(o1), torch.randn_like(s1)
        torch.autograd.backward((o1, s1), (do, dht))
        torch.autograd.backward((o2, s2), (do, dht))
    for name in x:
        a, b = raw[name].grad, leaves[name].grad
        assert a is not None and b is not None
        assert rel_err(b, a) <= 1e-5, name


def test_compile_fullgraph_gate_forward_backward() -> None:
    torch._dynamo.reset()

    def step(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:  # fmt: skip
        g = kda_ops.kda_gate(x, A_log, dt_bias)
        o, _ = kda_ops.chunk_kda(q, k, v, g, beta)
        return (o**2).sum() + g.sum()

    x = make_inputs(2, 9, 1, 4, 4, HV=2, gate_in_kernel=True)
    leaves = [t.requires_grad_() for t in (x["g"], x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["beta"])]
    assert_compiles_like_eager(step, leaves)


def _ok() -> dict[str, Any]:
    return {"g": torch.randn(2, 5, H, K), "A_log": torch.randn(H), "dt_bias": torch.randn(H * K)}


BAD: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "g not a tensor": ({"g": [[1.0]]}, TypeError, "g"),
    "g int": ({"g": torch.zeros(2, H, K, dtype=torch.int32)}, TypeError, "g"),
    "g 1-D": ({"g": torch.randn(K)}, ValueError, "g"),
    "no A_log, no lower_bound": ({"A_log": None}, ValueError, "A_log"),
    "A_log shape": ({"A_log": torch.randn(H + 1)}, ValueError, "A_log"),
    "A_log int": ({"A_log": torch.zeros(H, dtype=torch.int64)}, TypeError, "A_log"),
    "dt_bias shape": ({"dt_bias": torch.randn(H, K)}, ValueError, "dt_bias"),
    "dt_bias length": ({"dt_bias": torch.randn(H * K - 1)}, ValueError, "dt_bias"),
    "dt_bias device": ({"dt_bias": torch.randn(H * K, device="meta")}, ValueError, "dt_bias"),
    "lower_bound nan": ({"lower_bound": float("nan")}, ValueError, "lower_bound"),
    "lower_bound str": ({"lower_bound": "-5"}, TypeError, "lower_bound"),
    "lower_bound positive": ({"lower_bound": 5.0}, ValueError, "lower_bound"),
    "output_dtype int": ({"output_dtype": torch.int32}, TypeError, "output_dtype"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_gate_input_names_the_argument(case: str) -> None:
    over, exc, name = BAD[case]
    with pytest.raises(exc, match=rf"^{re.escape(name)}: expected"):
        kda_ops.kda_gate(**{**_ok(), **over})
