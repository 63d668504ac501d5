"""The torch.ops.kda layer on the CPU: op vs reference, opcheck, gradcheck, torch.compile, torch.export."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import kda_ops
from kda_ops import ops
from kda_ops.reference import naive_recurrent_kda
from kda_ops.testing import make_inputs, make_state, rel_err
from tests.cases import assert_compiles_like_eager, batch_transposed, state_transposed

F64 = torch.float64
SCHEDULES = {"chunk": kda_ops.chunk_kda, "recurrent": kda_ops.recurrent_kda}


def _op_args(x: dict[str, Any], *, h0: torch.Tensor | None = None, cu: torch.Tensor | None = None,
             final: bool = False, gate: bool = False) -> tuple[Any, ...]:  # fmt: skip
    """Positional arguments of kda::chunk / kda::recurrent."""
    K = x["q"].shape[-1]
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], K**-0.5, h0, cu, x.get("A_log"), x.get("dt_bias"), None,
            final, True, gate, True, False)  # fmt: skip


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_op_matches_oracle(schedule: str, dtype: torch.dtype) -> None:
    x = make_inputs(2, 19, 1, 8, 8, HV=2, dtype=dtype)
    h0 = make_state(2, 2, 8, 8)
    o, s = SCHEDULES[schedule](**x, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype and o.shape == (2, 19, 2, 8)
    assert s is not None and s.dtype == torch.float32 and s.shape == (2, 2, 8, 8)
    x64 = {n: t.double() for n, t in x.items()}
    o_ref, s_ref = naive_recurrent_kda(**x64, initial_state=h0.double(), output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert s_ref is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(o, o_ref) <= tol
    assert rel_err(s, s_ref) <= 1e-5


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_final_state_is_none(schedule: str) -> None:
    x = make_inputs(1, 4, 1, 4, 4)
    o, s = SCHEDULES[schedule](**x)
    assert s is None and o.shape == (1, 4, 1, 4)


BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.interpret)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B, T", [(0, 8), (0, 0), (2, 0)])
@pytest.mark.parametrize("h0", [False, True], ids=["zero_state", "initial_state"])
def test_empty_batch_gives_empty_outputs(backend: str, B: int, T: int, h0: bool) -> None:
    """No sequences (B = 0) or no tokens: both schedules return the same shapes, the final state is the initial
    one, and the backward runs."""
    x = {n: t.requires_grad_() for n, t in make_inputs(B, T, 1, 4, 4, HV=2).items()}
    state = make_state(B, 2, 4, 4).requires_grad_() if h0 else None
    with ops.cpu_backend(backend):
        o_r, s_r = kda_ops.recurrent_kda(**x, initial_state=state, output_final_state=True)
        o_c, s_c = kda_ops.chunk_kda(**x, initial_state=state, output_final_state=True)
        assert s_r is not None and s_c is not None
        assert o_c.shape == o_r.shape == (B, T, 2, 4) and s_c.shape == s_r.shape == (B, 2, 4, 4)
        assert torch.equal(s_c, s_r) and torch.equal(s_c, torch.zeros_like(s_c) if state is None else state)
        (o_c.sum() + s_c.sum()).backward()
    assert x["q"].grad is not None and x["q"].grad.shape == x["q"].shape


def test_fp64_chunk_beyond_head_dim_128_runs_the_reference(monkeypatch: Any) -> None:
    """fp64 chunk calls with a head dimension above 128 never reach a Triton kernel (its fp64 tiles exceed an H200's
    shared memory: the output stage asked 320 KB at K = V = 256), with or without autograd; fp32 calls do."""
    q = torch.zeros(1, 1, 1, 256, dtype=torch.float64)
    with ops.cpu_backend("triton"):
        assert not ops.uses_triton("chunk", q.device, q, q) and not ops.uses_triton("chunk_train", q.device, q, q)
        assert ops.uses_triton("chunk", q.device, q.float(), q.float())
        assert ops.uses_triton("chunk", q.device, q[..., :128], q[..., :128])

    def refuse(op: str) -> Any:
        raise AssertionError(f"Triton kernel {op} called")

    monkeypatch.setattr(ops, "_triton_kernel", refuse)
    x = {n: t.double().requires_grad_() for n, t in make_inputs(1, 8, 1, 256, 160, seed=0).items()}
    with ops.cpu_backend("triton"):
        o, s = kda_ops.chunk_kda(**x, output_final_state=True)
        (o.sum() + s.sum()).backward()
    o_ref, s_ref = naive_recurrent_kda(**{n: t.detach() for n, t in x.items()}, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10


def test_oracle_takes_an_empty_batch() -> None:
    o, s = naive_recurrent_kda(**make_inputs(0, 8, 1, 4, 4, HV=2), output_final_state=True)
    assert o.shape == (0, 8, 2, 4) and s is not None and s.shape == (0, 2, 4, 4)


OPCHECK_CASES = {
    "plain": {},
    "state": {"h0": True, "final": True},
    "varlen": {"cu": True, "h0": True, "final": True},
    "gate": {"gate": True, "final": True},
    "transposed": {"h0": True, "final": True, "transposed": True},  # dense, not contiguous: outputs contiguous
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
@pytest.mark.parametrize("op", ["chunk", "recurrent"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_forward(case: str, op: str, requires_grad: bool) -> None:
    c = OPCHECK_CASES[case]
    B, T = (1, 12) if c.get("cu") else (2, 6)
    x = make_inputs(B, T, 1, 4, 4, HV=2, gate_in_kernel=bool(c.get("gate")), beta_logits=True)
    cu = torch.tensor([0, 3, 3, 12]) if c.get("cu") else None
    h0 = make_state(3 if cu is not None else B, 2, 4, 4) if c.get("h0") else None
    if c.get("transposed"):
        x = {n: batch_transposed(t) if t.dim() >= 3 else t for n, t in x.items()}
        h0 = None if h0 is None else state_transposed(h0)
    if requires_grad:
        x = {n: t.requires_grad_() for n, t in x.items()}
        h0 = None if h0 is None else h0.requires_grad_()
    args = _op_args(x, h0=h0, cu=cu, final=bool(c.get("final")), gate=bool(c.get("gate")))
    torch.library.opcheck(getattr(torch.ops.kda, op).default, args)


@pytest.mark.parametrize("op", ["chunk_bwd", "recurrent_bwd"])
@pytest.mark.parametrize("transposed", [False, True])
def test_opcheck_backward(op: str, transposed: bool) -> None:
    x = make_inputs(1, 12, 1, 4, 4, HV=2, gate_in_kernel=True, beta_logits=True)
    cu = torch.tensor([0, 5, 12])
    h0 = make_state(2, 2, 4, 4)
    if transposed:  # dense, not contiguous: the gradients contiguous
        x = {n: t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() >= 4 else t for n, t in x.items()}
        h0 = state_transposed(h0)
    do, dht = torch.randn_like(x["v"]), torch.randn_like(h0)
    args = (do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, h0, cu, x["A_log"], x["dt_bias"], None,
            True, True, True, True)  # fmt: skip
    torch.library.opcheck(getattr(torch.ops.kda, op).default, args)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("varlen", [False, True])
def test_gradcheck(schedule: str, varlen: bool) -> None:
    B, T = (1, 7) if varlen else (2, 4)
    x = make_inputs(B, T, 1, 3, 2, HV=2, dtype=F64, gate_in_kernel=True, beta_logits=True)
    cu = torch.tensor([0, 2, 2, 7]) if varlen else None
    h0 = make_state(3 if varlen else B, 2, 3, 2, dtype=F64)
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias"]
    fn = SCHEDULES[schedule]

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          A_log: torch.Tensor, dt_bias: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                  use_beta_sigmoid_in_kernel=True)  # fmt: skip
        assert s is not None
        return o, s

    inputs = tuple(x[n].clone().requires_grad_() for n in names) + (h0.clone().requires_grad_(),)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_backward_from_one_output_alone(schedule: str) -> None:
    """A loss of the final state alone (o's gradient never materialised: the op's backward gets None for it) or of
    o alone gives the gradients of the same loss with the other output times zero."""
    fn = SCHEDULES[schedule]
    x = make_inputs(2, 5, 1, 3, 2, HV=2, dtype=F64)
    h0 = make_state(2, 2, 3, 2, dtype=F64)
    for alone in ("state", "o"):
        grads = []
        for zero_other in (False, True):
            xs = {n: t.clone().requires_grad_() for n, t in x.items()}
            o, s = fn(**xs, initial_state=h0, output_final_state=True)
            assert s is not None
            loss = s.sum() if alone == "state" else o.sum()
            if zero_other:
                loss = loss + 0 * (o.sum() if alone == "state" else s.sum())
            loss.backward()
            grads.append([xs[n].grad for n in xs])
        for name, a, b in zip(x, *grads):
            assert a is not None and b is not None, name
            torch.testing.assert_close(a, b, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_compile_fullgraph_forward_backward(schedule: str) -> None:
    torch._dynamo.reset()
    fn = SCHEDULES[schedule]

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             h0: torch.Tensor) -> torch.Tensor:  # fmt: skip
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert s is not None
        return (o.float() ** 2).sum() + s.sum()

    x = make_inputs(2, 9, 1, 4, 4, HV=2)
    h0 = make_state(2, 2, 4, 4)
    leaves = [t.requires_grad_() for t in (*x.values(), h0)]
    assert_compiles_like_eager(step, leaves)


def test_compile_one_graph_across_T() -> None:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True)
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        return kda_ops.chunk_kda(q, k, v, g, beta, scale=0.5)[0]

    for T in (8, 13, 21):
        x = make_inputs(1, T, 1, 4, 4, seed=T)
        for t in x.values():
            torch._dynamo.mark_dynamic(t, 1)
        torch.testing.assert_close(f(**x), kda_ops.chunk_kda(**x, scale=0.5)[0])
    assert counter.frame_count == 1


def test_compile_varlen_values_do_not_recompile() -> None:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True)
    def f(x: dict[str, torch.Tensor], cu: torch.Tensor) -> torch.Tensor:
        return kda_ops.chunk_kda(**x, cu_seqlens=cu)[0]

    x = make_inputs(1, 16, 1, 4, 4)
    for cu in ([0, 4, 16], [0, 0, 16], [0, 15, 16]):
        cu_t = torch.tensor(cu)
        torch.testing.assert_close(f(x, cu_t), kda_ops.chunk_kda(**x, cu_seqlens=cu_t)[0])
    assert counter.frame_count == 1


class _Layer(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        o, s = kda_ops.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert s is not None
        return o, s


def test_export() -> None:
    x = make_inputs(2, 10, 1, 4, 4, HV=2)
    h0 = make_state(2, 2, 4, 4)
    args = (*x.values(), h0)
    ep = torch.export.export(_Layer(), args)
    assert any("kda.chunk" in str(n.target) for n in ep.graph.nodes)
    for a, b in zip(ep.module()(*args), _Layer()(*args)):
        torch.testing.assert_close(a, b)


def test_eager_calls_skip_the_dispatcher_only_when_it_would_only_pick_the_kernel(monkeypatch: Any) -> None:
    """The public functions call the op's kernel function directly in plain eager calls (the decode step's host
    cost), and the op whenever autograd, a dispatch or function mode, or a tensor subclass needs the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kda_ops import ops

    direct_calls: list[str] = []
    for name in ("recurrent", "chunk", "recurrent_update_"):
        op = getattr(ops, name)
        kernel = ops._DIRECT[op]
        monkeypatch.setitem(ops._DIRECT, op, lambda *a, _k=kernel, _n=name: direct_calls.append(_n) or _k(*a))

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    x = make_inputs(2, 5, 1, 8, 8, HV=2)
    h0 = make_state(2, 2, 8, 8)
    via_op = torch.ops.kda.recurrent(*_op_args(x, h0=h0, final=True))
    o, s = kda_ops.recurrent_kda(**x, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 use_beta_sigmoid_in_kernel=True)  # fmt: skip
    assert direct_calls == ["recurrent"]
    assert torch.equal(o, via_op[0]) and s is not None and torch.equal(s, via_op[1])
    kda_ops.chunk_kda(**x)
    pool = make_state(4, 2, 8, 8)
    kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=torch.tensor([2, 0]))
    assert direct_calls == ["recurrent", "chunk", "recurrent_update_"]
    # autograd records the op: through the dispatcher
    q = x["q"].clone().requires_grad_(True)
    o, _ = kda_ops.recurrent_kda(**{**x, "q": q})
    assert o.requires_grad and len(direct_calls) == 3
    with torch.no_grad():
        kda_ops.recurrent_kda(**{**x, "q": q})
    assert len(direct_calls) == 4
    # a dispatch mode and a tensor subclass see the op
    with Passthrough():
        kda_ops.recurrent_kda(**x)
    kda_ops.recurrent_kda(**{**x, "q": torch.nn.Parameter(x["q"], requires_grad=False)})
    assert len(direct_calls) == 4
    # meta tensors (shape inference): the dispatcher's fake kernels, outputs of the contract's shapes
    meta = {name: t.to("meta") for name, t in x.items()}
    for fn in (kda_ops.chunk_kda, kda_ops.recurrent_kda):
        o, s = fn(**meta, initial_state=h0.to("meta"), output_final_state=True)
        assert o.device.type == "meta" and o.shape == x["v"].shape and s is not None and s.shape == h0.shape
    slots = torch.tensor([2, 0], device="meta")
    o = kda_ops.recurrent_kda_update_(**meta, state_pool=pool.to("meta"), state_indices=slots)
    assert o.device.type == "meta" and o.shape == x["v"].shape
    assert len(direct_calls) == 4
