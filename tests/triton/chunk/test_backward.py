"""``kda_ops.triton.chunk.backward``: the chunkwise backward driver on the CPU under ``TRITON_INTERPRET=1``.

The whole backward (``KERNELS["chunk_bwd"]``) against the analytic reference backward for every option, and
through ``torch.autograd`` on ``kda_ops.chunk_kda`` (ops routed to Triton) against autograd of the float64 naive
recurrence; the training pair (``kda::chunk_train``, whose kernel is ``chunk_fwd_train`` of
``kda_ops.triton.chunk.forward``, and ``kda::chunk_bwd_saved``) against the recompute, through ``torch.compile``,
``gradcheck`` and ``opcheck``. A packed batch with an empty and a one-token sequence, grouped value heads, hard
resets (g = -1000) and zero gates. Outputs and scratch buffers are poisoned with NaN first. Shapes are tiny: the
interpreter runs programs one by one. The stages alone: ``test_scan_bwd.py``, ``test_dv.py``, ``test_dqk.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

import kda_ops  # noqa: E402
from kda_ops import ops, reference  # noqa: E402
from kda_ops.reference import naive_recurrent_kda  # noqa: E402
from kda_ops.testing import assert_rel, make_inputs, make_state  # noqa: E402
from kda_ops.triton import KERNELS  # noqa: E402
from tests.cases import CU_BWD, F64, OPTIONS, options, set_gates  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS  # noqa: E402

pytestmark = [pytest.mark.interpret, *OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]

N = len(CU_BWD) - 1


def _case(option: str, gates: str, dtype: torch.dtype, HV: int, packed: bool, seed: int = 0) -> dict[str, Any]:
    make_opts, call_opts = OPTIONS[option]
    B, T = (1, CU_BWD[-1]) if packed else (2, 40)
    x = make_inputs(B, T, 2 if HV == 4 else 1, 16, 16, HV=HV, dtype=dtype, seed=seed, **make_opts)
    set_gates(x["g"], gates)
    for name in ("A_log", "dt_bias"):
        if name in call_opts:
            x.pop(name, None)
    n = N if packed else B
    call = {k_: v_ for k_, v_ in call_opts.items() if k_ not in ("A_log", "dt_bias")}
    return {"x": x, "call": call, "opts": options(call_opts), "h0": make_state(n, HV, 16, 16),
            "cu": torch.tensor(CU_BWD) if packed else None, "n": n}  # fmt: skip


@pytest.mark.parametrize(
    ("option", "gates", "dtype", "HV", "packed"),
    [
        pytest.param("plain", "reset", torch.float32, 2, True, marks=pytest.mark.slow),
        pytest.param("all", "normal", torch.float32, 4, True, marks=pytest.mark.slow),
        ("lower_bound", "normal", torch.float32, 2, False),
        ("lower_bound_no_A", "zero", torch.float32, 1, True),
        ("gate_no_dt_bias", "normal", torch.float32, 1, False),
        ("beta_sigmoid", "normal", torch.float16, 2, True),
        ("all", "normal", torch.float16, 1, False),  # the l2norm's gradient in the dq/dk stage, in fp16
    ],
)
def test_chunk_bwd_kernel_matches_reference(option: str, gates: str, dtype: torch.dtype, HV: int,
                                            packed: bool) -> None:  # fmt: skip
    """The whole Triton backward (KERNELS["chunk_bwd"]) against the analytic backward in float64."""
    c = _case(option, gates, dtype, HV, packed)
    x = c["x"]
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(x["v"].shape, generator=gen).to(dtype)
    dht = torch.randn(c["h0"].shape, generator=gen)
    common = (0.3, c["h0"], c["cu"], x.get("A_log"), x.get("dt_bias"), c["opts"])
    got = KERNELS["chunk_bwd"](do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], *common)

    def d(t: Any) -> Any:
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    ref = reference.chunk_bwd(*(d(t) for t in (do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], *common)))
    # fp16 inputs: the oracle sees the same fp16 values; the kernel computes in fp32 and rounds the gradients
    tol = 2e-4 if dtype == torch.float32 else 2e-3
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"), got, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == (torch.float32 if name in ("dh0", "dA_log", "ddt_bias") else x[name[1:]].dtype), name
            assert_rel(a, b, tol, name)


@pytest.mark.slow
@pytest.mark.parametrize(("option", "gates", "HV"), [("all", "reset", 2), ("lower_bound", "normal", 4)])
def test_autograd_matches_naive(option: str, gates: str, HV: int) -> None:
    """torch.autograd through kda_ops.chunk_kda (forward and backward in Triton) against autograd of the float64
    naive recurrence: every input's gradient, the initial state's, with a final-state gradient."""
    assert "chunk_bwd" in ops.TRITON_KERNELS
    c = _case(option, gates, torch.float32, HV, packed=True)
    x = c["x"]
    xs = {n: t.clone().requires_grad_() for n, t in x.items()}
    xd = {n: t.double().requires_grad_() for n, t in x.items()}
    h0 = c["h0"].clone().requires_grad_()
    h0d = c["h0"].double().requires_grad_()
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(x["v"].shape, generator=gen)
    dht = torch.randn(c["h0"].shape, generator=gen)
    o, s = kda_ops.chunk_kda(**xs, initial_state=h0, output_final_state=True, cu_seqlens=c["cu"], scale=0.3,
                             **c["call"])  # fmt: skip
    o_r, s_r = naive_recurrent_kda(**xd, initial_state=h0d, output_final_state=True, cu_seqlens=c["cu"], scale=0.3,
                                   **c["call"])  # fmt: skip
    assert s is not None and s_r is not None
    ((o * do).sum() + (s * dht).sum()).backward()
    ((o_r * do.double()).sum() + (s_r * dht.double()).sum()).backward()
    for name in xs:
        grad, ref = xs[name].grad, xd[name].grad
        assert grad is not None and ref is not None, name
        assert_rel(grad, ref, 2e-4, f"d{name}")
    assert h0.grad is not None and h0d.grad is not None
    assert_rel(h0.grad, h0d.grad, 2e-4, "dh0")


@pytest.mark.slow
@pytest.mark.parametrize(("option", "dtype", "packed"), [("all", torch.float32, True), ("plain", torch.float16, False)])
def test_training_pair_keeps_what_the_recompute_makes(option: str, dtype: torch.dtype, packed: bool) -> None:
    """``kda::chunk_train`` + ``kda::chunk_bwd_saved`` (the default where autograd records a call) against
    ``kda::chunk`` + ``kda::chunk_bwd`` (``recompute_in_backward=True``): the same gradients bit for bit (the
    saved factors are the recompute's), outputs equal to rounding; the saved factors have the fake's shapes and
    dtypes; the op fails clearly where the Triton kernels do not run."""
    c = _case(option, "reset", dtype, 2, packed)
    x = c["x"]
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(x["v"].shape, generator=gen).to(dtype)
    dht = torch.randn(c["h0"].shape, generator=gen)
    runs = []
    for recompute in (False, True):
        xs = {n: t.clone().requires_grad_() for n, t in x.items()}
        h0 = c["h0"].clone().requires_grad_()
        o, s = kda_ops.chunk_kda(**xs, initial_state=h0, output_final_state=True, cu_seqlens=c["cu"], scale=0.3,
                                 recompute_in_backward=recompute, **c["call"])  # fmt: skip
        assert s is not None
        ((o.float() * do.float()).sum() + (s * dht).sum()).backward()
        runs.append((o.detach(), s.detach(), {n: t.grad for n, t in xs.items()}, h0.grad))
    (o1, s1, g1, h1), (o2, s2, g2, h2) = runs
    xd = {n: t.double() for n, t in x.items()}
    o_r, s_r = naive_recurrent_kda(**xd, initial_state=c["h0"].double(), output_final_state=True,
                                   cu_seqlens=c["cu"], scale=0.3, **c["call"])  # fmt: skip
    assert s_r is not None
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert_rel(o1, o_r, tol, "o")
    assert_rel(s1, s_r, tol, "final_state")
    for name in g1:
        assert g1[name] is not None and g2[name] is not None, name
        assert torch.equal(g1[name], g2[name]), name
    assert h1 is not None and h2 is not None and torch.equal(h1, h2)
    # the real outputs against the fake function's
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, c["h0"], c["cu"], x.get("A_log"), x.get("dt_bias"),
            c["opts"].lower_bound, True, c["opts"].use_qk_l2norm, c["opts"].use_gate, c["opts"].use_beta_sigmoid,
            c["opts"].allow_neg_eigval)  # fmt: skip
    real = ops.chunk_train(*args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.chunk_train(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in fake]
    with ops.cpu_backend("reference"), pytest.raises(NotImplementedError, match="kda::chunk_train runs only"):
        ops.chunk_train(*args)


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_no_tokens(recompute: bool) -> None:
    """No token at all (a dense T = 0, or packed empty sequences): the final state is the initial state (zeros
    without one) and its gradient passes straight to the initial state (a copy: an op's output never aliases an
    input)."""
    for cu in (None, torch.tensor([0, 0, 0])):
        x = make_inputs(1, 0, 1, 16, 16, HV=2)
        xs = {n: t.clone().requires_grad_() for n, t in x.items()}
        n = 1 if cu is None else 2
        h0 = make_state(n, 2, 16, 16).requires_grad_()
        o, s = kda_ops.chunk_kda(**xs, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                 use_qk_l2norm_in_kernel=True, recompute_in_backward=recompute)  # fmt: skip
        assert s is not None and o.shape == x["v"].shape and torch.equal(s, h0)
        dht = torch.randn_like(s)
        (s * dht).sum().backward()
        assert h0.grad is not None and torch.equal(h0.grad, dht)
        assert all(xs[name].grad is not None and xs[name].grad.shape == x[name].shape for name in xs)


@pytest.mark.slow
def test_compile_training_pair_dynamic_shapes() -> None:
    """A training step through ``torch.compile(fullgraph=True, dynamic=True)`` (the training pair's fake functions
    with symbolic T): loss and gradients equal to eager at two lengths, 0 graph breaks."""

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             h0: torch.Tensor) -> torch.Tensor:  # fmt: skip
        o, s = kda_ops.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert s is not None
        return (o.float() ** 2).sum() + s.sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for T in (40, 70):
        x = make_inputs(2, T, 1, 16, 16, HV=2)
        runs = []
        for fn in (compiled, step):
            xs = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
            h0 = make_state(2, 2, 16, 16).requires_grad_()
            loss = fn(*xs, h0)
            loss.backward()
            runs.append((loss.detach(), [t.grad for t in (*xs, h0)]))
        (l1, g1), (l2, g2) = runs
        assert torch.equal(l1, l2)
        assert all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(g1, g2))
    assert torch._dynamo.explain(step)(*xs, h0).graph_break_count == 0


@pytest.mark.slow
def test_gradcheck_training_pair() -> None:
    """``torch.autograd.gradcheck`` (float64, fast mode) through ``chunk_kda``'s training pair with every option,
    packed sequences (an empty one) and an initial state: the kept factors' backward is the forward's derivative."""
    x = make_inputs(1, 9, 1, 16, 16, HV=2, dtype=F64, gate_in_kernel=True, beta_logits=True)
    cu = torch.tensor([0, 4, 4, 9])
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias"]

    def f(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g, beta, A_log, dt_bias, h0 = args
        o, s = kda_ops.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                 use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)  # fmt: skip
        assert s is not None
        return o, s

    inputs = (*(x[n].clone().requires_grad_() for n in names), make_state(3, 2, 16, 16, dtype=F64).requires_grad_())
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5, fast_mode=True)


@pytest.mark.slow
def test_opcheck_training_pair() -> None:
    """``torch.library.opcheck`` of ``kda::chunk_train`` (inputs requiring grad: its autograd) and of
    ``kda::chunk_bwd_saved`` on the factors it kept, under the interpreter."""
    c = _case("all", "normal", torch.float32, 2, packed=False)
    x = {n: t.requires_grad_() for n, t in c["x"].items()}
    h0 = c["h0"].requires_grad_()
    o = c["opts"]
    flags = (o.use_qk_l2norm, o.use_gate, o.use_beta_sigmoid, o.allow_neg_eigval)
    inputs = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, h0, None, x.get("A_log"), x.get("dt_bias"))
    torch.library.opcheck(ops.chunk_train, (*inputs, o.lower_bound, True, *flags))
    with torch.no_grad():
        out = ops.chunk_train(*inputs, o.lower_bound, True, *flags)
    do, dht = torch.randn_like(out[0]), torch.randn_like(out[1])
    plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in inputs)
    torch.library.opcheck(ops.chunk_bwd_saved, (do, dht, *plain, *out[2:], o.lower_bound, *flags))
