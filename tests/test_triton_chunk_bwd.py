"""The chunkwise Triton backward on the CPU under ``TRITON_INTERPRET=1``.

Each backward stage against its own oracle (``kda_ops.reference.chunk_bwd_stages``, float64), fed the float64
oracle's forward factors so that a stage is tested alone; then the whole backward (``KERNELS["chunk_bwd"]``)
against the analytic reference backward for every option, and through ``torch.autograd`` on
``kda_ops.chunk_kda`` (ops routed to Triton) against autograd of the float64 naive recurrence. A packed batch with
an empty and a one-token sequence, grouped value heads, hard resets (g = -1000) and zero gates. Outputs and
scratch buffers are poisoned with NaN first. Shapes are tiny: the interpreter runs programs one by one.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import kda_ops  # noqa: E402
from kda_ops import ops, reference  # noqa: E402
from kda_ops.common import Options  # noqa: E402
from kda_ops.reference import chunk_bwd_stages as bwd_oracle  # noqa: E402
from kda_ops.reference import chunk_stages as oracle  # noqa: E402
from kda_ops.reference import naive_recurrent_kda  # noqa: E402
from kda_ops.testing import assert_rel, make_inputs, make_state  # noqa: E402
from kda_ops.triton import KERNELS  # noqa: E402
from kda_ops.triton import chunk_state as ts  # noqa: E402
from kda_ops.triton.chunk_bwd_dqk import chunk_bwd_dqk  # noqa: E402
from kda_ops.triton.chunk_bwd_dv import chunk_bwd_dv  # noqa: E402
from kda_ops.triton.chunk_bwd_scan import chunk_bwd_scan  # noqa: E402
from kda_ops.triton.chunk_common import BT, exact_bf16  # noqa: E402
from kda_ops.triton.debug import poison_outputs  # noqa: E402
from kda_ops.varlen import chunk_slots  # noqa: E402

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning"),
]

F64 = torch.float64
# packed sequences of 5, 0, 65 (a full chunk and one token), 1 and 9 tokens: 6 slots, 5 of them used
CU = [0, 5, 5, 70, 71, 80]
N = len(CU) - 1

# name -> (make_inputs options, public-function options)
OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({}, {}),
    "gate_no_dt_bias": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True, "dt_bias": None}),
    "lower_bound": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True, "lower_bound": -5.0}),
    "lower_bound_no_A": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True, "lower_bound": -3.0, "A_log": None}),
    "beta_sigmoid": ({"beta_logits": True}, {"use_beta_sigmoid_in_kernel": True}),
    "all": (
        {"gate_in_kernel": True, "beta_logits": True},
        {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
         "allow_neg_eigval": True},
    ),  # fmt: skip
}


@pytest.fixture(autouse=True)
def _triton_path() -> Iterator[None]:
    with ops.cpu_backend("triton"), poison_outputs():
        yield


def _opts(call: dict[str, Any]) -> Options:
    return Options(
        call.get("use_qk_l2norm_in_kernel", False),
        call.get("use_gate_in_kernel", False),
        call.get("use_beta_sigmoid_in_kernel", False),
        call.get("allow_neg_eigval", False),
        call.get("lower_bound"),
    )


def _set_gates(g: torch.Tensor, gates: str) -> None:
    """``reset``: g = -1000 at a few tokens (every channel, or half of them); ``half_reset``: at one token, in half
    the channels only (one chunk's key tiles then take different paths); ``zero``: no decay."""
    if gates == "reset":
        T = g.shape[1]
        g[:, [t for t in (3, 20, 64, 66) if t < T]] = -1000.0
        g[:, 40 % T, :, : g.shape[-1] // 2] = -1000.0
    elif gates == "half_reset":
        g[:, 100 % g.shape[1], :, : g.shape[-1] // 2] = -1000.0
    elif gates == "zero":
        g.zero_()


# ------------------------------------------------------------------------------------------------ stages


def _stage_case(gates: str, H: int = 1, HV: int = 2, K: int = 20, V: int = 12) -> dict[str, Any]:
    """Prepared float64 inputs over the packed batch CU, the oracle's forward factors and random dO, dht."""
    x = make_inputs(1, CU[-1], H, K, V, HV=HV, dtype=F64, seed=5)
    _set_gates(x["g"], gates)
    q, k, v, g, beta = (x[n][0] for n in ("q", "k", "v", "g", "beta"))
    q, k = reference.l2norm(q), reference.l2norm(k)
    cu = torch.tensor(CU, dtype=torch.int64)
    slots = chunk_slots(cu, CU[-1], BT)
    qe, ke = q.repeat_interleave(HV // H, 1), k.repeat_interleave(HV // H, 1)
    Mqk, Mkk, Qt, Kend, Gl = oracle.chunk_intra(qe, ke, g, beta, 0.4, slots, BT)
    Tm, W, U = oracle.chunk_solve(Mkk, ke, v, g, beta, slots, BT)
    h0 = make_state(N, HV, K, V, dtype=F64)
    Hin, E, _ = oracle.chunk_state(W, U, Kend, Gl, h0, slots, BT)
    gen = torch.Generator().manual_seed(7)
    dO = torch.randn(CU[-1], HV, V, generator=gen, dtype=F64)
    dht = torch.randn(N, HV, K, V, generator=gen, dtype=F64)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu=cu, slots=slots, Mqk=Mqk, Qt=Qt, Kend=Kend, Gl=Gl, Tm=Tm, W=W,
                Hin=Hin, E=E, dO=dO, dht=dht)  # fmt: skip


def _f32(c: dict[str, Any], *names: str) -> list[torch.Tensor]:
    return [c[n].float() for n in names]


@pytest.mark.parametrize(("gates", "tiles", "with_dht"), [("normal", None, True), ("reset", 16, False)])
def test_stage_scan(gates: str, tiles: int | None, with_dht: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ts, "BV_OVERRIDE", tiles)
    c = _stage_case(gates, V=24)
    dht = c["dht"] if with_dht else None
    dO, Mqk, Qt, Kend, W, Gl = _f32(c, "dO", "Mqk", "Qt", "Kend", "W", "Gl")
    dE, dSp, dh0 = chunk_bwd_scan(dO, Mqk, Qt, Kend, W, Gl, None if dht is None else dht.float(), c["cu"], "ieee")
    ref = bwd_oracle.bwd_scan(c["dO"], c["Mqk"], c["Qt"], c["Kend"], c["W"], c["Gl"], dht, c["slots"], BT, N)
    used = c["slots"].count > 0
    assert dh0 is not None
    assert_rel(dE, ref[0], 1e-5, "dE")
    assert_rel(dSp[used], ref[1][used], 1e-5, "dS'")
    assert_rel(dh0, ref[2], 1e-5, "dh0")
    if with_dht:  # the empty sequence passes the final-state gradient through
        torch.testing.assert_close(dh0[1], dht[1].float())
    # dS' stored in bf16 (the driver's choice for bf16 inputs): one rounding of the same values (within one bf16 ulp:
    # the interpreter truncates where the GPU rounds to nearest), and the scan's carried dS (so dE, dh0) untouched
    dE16, dSp16, dh016 = chunk_bwd_scan(dO, Mqk, Qt, Kend, W, Gl, None if dht is None else dht.float(), c["cu"], "ieee",
                                        dsp_dtype=torch.bfloat16)  # fmt: skip
    assert dSp16.dtype == torch.bfloat16 and dE16.dtype == torch.float32
    torch.testing.assert_close(dSp16[used].float(), dSp[used], rtol=2.0**-7, atol=1e-30)
    assert torch.equal(dE16, dE) and dh016 is not None and torch.equal(dh016, dh0)


def _dv_inputs(c: dict[str, Any]) -> dict[str, torch.Tensor]:
    dE, dSp, _ = bwd_oracle.bwd_scan(c["dO"], c["Mqk"], c["Qt"], c["Kend"], c["W"], c["Gl"], c["dht"], c["slots"], BT,
                                     N)  # fmt: skip
    return {"dE": dE, "dSp": dSp}


def test_exact_bf16_only_for_bf16_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Products whose operands are all stored in bf16 run in bf16 on the GPU (exact operands: the same products);
    any other operand dtype keeps the given precision, and so does the interpreter."""
    b, h, f = (torch.zeros(2, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.float32))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert exact_bf16("tf32", b, b) == "bf16"
    assert exact_bf16("tf32", b, f) == exact_bf16("tf32", h, b) == "tf32"
    assert exact_bf16("ieee", f, f) == "ieee"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert exact_bf16("tf32", b, b) == "tf32"


@pytest.mark.parametrize("gates", ["normal", "reset"])
def test_stage_dv(gates: str) -> None:
    c = _stage_case(gates, H=1, HV=2)
    c.update(_dv_inputs(c))
    got = chunk_bwd_dv(*_f32(c, "k", "v", "g", "beta", "Tm", "Hin", "E", "dE", "dO"), c["slots"], "ieee", "ieee")
    ref = bwd_oracle.bwd_dv(c["k"], c["v"], c["g"], c["beta"], c["Tm"], c["Hin"], c["E"], c["dE"], c["dO"],
                            c["slots"], BT)  # fmt: skip
    for name, a, b in zip(("dv", "dbeta", "dMqk", "dMkk", "dKt", "Gam"), got, ref):
        assert_rel(a, b, 1e-5, name)
    # dMqk, dMkk, dKt stored in bf16 (the driver's choice for bf16 inputs): one rounding each (within one bf16 ulp:
    # the interpreter truncates where the GPU rounds to nearest); dv, dbeta and Gam untouched
    got16 = chunk_bwd_dv(*_f32(c, "k", "v", "g", "beta", "Tm", "Hin", "E", "dE", "dO"), c["slots"], "ieee", "ieee",
                         store=torch.bfloat16)  # fmt: skip
    for name, a, b in zip(("dv", "dbeta", "dMqk", "dMkk", "dKt", "Gam"), got16, got):
        if name in ("dMqk", "dMkk", "dKt"):
            assert a.dtype == torch.bfloat16, name
            torch.testing.assert_close(a.float(), b, rtol=2.0**-7, atol=1e-30, msg=name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("gates", ["normal", "reset", "half_reset", "zero"])
def test_stage_dqk(gates: str) -> None:
    """The dq/dk stage against its float64 oracle, every output poisoned first (K = 40: two key tiles, the second
    partial; with ``half_reset`` one chunk's key tiles span differently)."""
    c = _stage_case(gates, H=1, HV=2, K=40)
    c.update(_dv_inputs(c))
    _, dbeta, dMqk, dMkk, dKt, Gam = bwd_oracle.bwd_dv(c["k"], c["v"], c["g"], c["beta"], c["Tm"], c["Hin"], c["E"],
                                                      c["dE"], c["dO"], c["slots"], BT)  # fmt: skip
    c.update(dbeta=dbeta, dMqk=dMqk, dMkk=dMkk, dKt=dKt, Gam=Gam)
    names = ("q", "k", "Gam", "Gl", "beta", "dMqk", "dMkk", "dKt", "Hin", "E", "dSp", "dO", "dbeta")
    with poison_outputs():
        got = chunk_bwd_dqk(*_f32(c, *names), 0.4, c["slots"], "ieee")
    ref = bwd_oracle.bwd_dqk(*(c[n] for n in names), 0.4, c["slots"], BT)
    # resets: Gam reaches -1000 and fp32 rounds it to ~6e-5 nats, which the pairwise differences carry
    tol = 1e-4 if gates.endswith("reset") else 1e-5
    for name, a, b in zip(("dq", "dk", "dg", "dbeta"), got, ref):
        assert_rel(a, b, tol, name)


def test_stage_dqk_block_pass_equals_anchored_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the anchored span below 0 the first pass flags every chunk and the block pass computes them all: the
    same gradients as the anchored pass (two fp32 factorings of the same decays)."""
    dqk_module = importlib.import_module("kda_ops.triton.chunk_bwd_dqk")
    c = _stage_case("normal", H=1, HV=2)
    c.update(_dv_inputs(c))
    _, dbeta, dMqk, dMkk, dKt, Gam = bwd_oracle.bwd_dv(c["k"], c["v"], c["g"], c["beta"], c["Tm"], c["Hin"], c["E"],
                                                      c["dE"], c["dO"], c["slots"], BT)  # fmt: skip
    c.update(dbeta=dbeta, dMqk=dMqk, dMkk=dMkk, dKt=dKt, Gam=Gam)
    names = ("q", "k", "Gam", "Gl", "beta", "dMqk", "dMkk", "dKt", "Hin", "E", "dSp", "dO", "dbeta")
    with poison_outputs():
        anchored = chunk_bwd_dqk(*_f32(c, *names), 0.4, c["slots"], "ieee")
        monkeypatch.setattr(dqk_module, "ANCHOR_SPAN", -1.0)
        blocks = chunk_bwd_dqk(*_f32(c, *names), 0.4, c["slots"], "ieee")
    for name, a, b in zip(("dq", "dk", "dg", "dbeta"), anchored, blocks):
        assert_rel(a, b, 1e-5, name)


# ---------------------------------------------------------------------------------------------- pipeline


def _case(option: str, gates: str, dtype: torch.dtype, HV: int, packed: bool, seed: int = 0) -> dict[str, Any]:
    make_opts, call_opts = OPTIONS[option]
    B, T = (1, CU[-1]) if packed else (2, 40)
    x = make_inputs(B, T, 2 if HV == 4 else 1, 16, 16, HV=HV, dtype=dtype, seed=seed, **make_opts)
    _set_gates(x["g"], gates)
    for name in ("A_log", "dt_bias"):
        if name in call_opts:
            x.pop(name, None)
    n = N if packed else B
    call = {k_: v_ for k_, v_ in call_opts.items() if k_ not in ("A_log", "dt_bias")}
    return {"x": x, "call": call, "opts": _opts(call_opts), "h0": make_state(n, HV, 16, 16),
            "cu": torch.tensor(CU) if packed else None, "n": n}  # fmt: skip


@pytest.mark.parametrize(
    ("option", "gates", "dtype", "HV", "packed"),
    [
        ("plain", "reset", torch.float32, 2, True),
        ("all", "normal", torch.float32, 4, True),
        ("lower_bound", "normal", torch.float32, 2, False),
        ("lower_bound_no_A", "zero", torch.float32, 1, True),
        ("gate_no_dt_bias", "normal", torch.float32, 1, False),
        ("beta_sigmoid", "normal", torch.float16, 2, True),
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


@pytest.mark.parametrize("K", [64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_l2norm_and_its_gradient(K: int, dtype: torch.dtype) -> None:
    """The one-pass l2norm kernels against the oracle's formula and autograd of it (float64), rows past a
    program's block and a zero row included."""
    from kda_ops.reference.gates import l2norm as l2norm_ref
    from kda_ops.triton.l2norm import l2norm, l2norm_bwd, l2norm_factors

    x = torch.randn(3, 7, K, dtype=F64)
    x[1, 2] = 0.0
    dy = torch.randn(3, 7, K, dtype=F64)
    xd = x.to(dtype)
    y = l2norm(xd, torch.float32)
    dx = l2norm_bwd(xd, dy.float())
    xr = xd.to(F64).requires_grad_()
    yr = l2norm_ref(xr)
    (dxr,) = torch.autograd.grad(yr, xr, dy)
    assert y.dtype == torch.float32 and dx.dtype == torch.float32
    assert_rel(y, yr.detach(), 1e-6)
    assert_rel(dx, dxr, 1e-5)
    # the driver's form: the gradient stored in the input's own dtype, one rounding of the fp32 value
    dx_in = l2norm_bwd(xd, dy.float(), dtype)
    assert dx_in.dtype == dtype
    assert torch.equal(dx_in, dx.to(dtype))
    # the factors alone, as the backward's kernels take them: x r is the normalised row, bit for bit
    r = l2norm_factors(xd, torch.float32)
    assert r.shape == (3, 7) and r.dtype == torch.float32
    assert torch.equal(xd.float() * r[..., None], y)
