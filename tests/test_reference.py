"""The oracle: the chunkwise and sync-free recurrent references against the naive recurrence, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kda_ops.common import Options
from kda_ops.reference import chunk_bwd, chunk_fwd, naive_recurrent_kda, recurrent_fwd
from kda_ops.reference.gates import gate, l2norm
from kda_ops.testing import make_inputs, make_state, rel_err

F64 = torch.float64


@pytest.mark.parametrize("T", [1, 15, 16, 17, 50])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("HV", [2, 4])
def test_chunk_matches_naive_float64(T: int, chunk_size: int, HV: int) -> None:
    x = make_inputs(2, T, 2, 8, 6, HV=HV, dtype=F64, seed=T)
    h0 = make_state(2, HV, 8, 6, dtype=F64)
    o_ref, s_ref = naive_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    assert s_ref is not None
    o, s = chunk_fwd(**x, scale=8**-0.5, initial_state=h0, cu_seqlens=None, A_log=None, dt_bias=None,
                     opts=Options(), output_final_state=True, chunk_size=chunk_size)  # fmt: skip
    assert rel_err(o, o_ref) <= 1e-10
    assert rel_err(s, s_ref) <= 1e-10
    o2, s2 = recurrent_fwd(**x, scale=8**-0.5, initial_state=h0, cu_seqlens=None, A_log=None, dt_bias=None,
                           opts=Options(), output_final_state=True)  # fmt: skip
    assert rel_err(o2, o_ref) <= 1e-12
    assert rel_err(s2, s_ref) <= 1e-12


def test_chunk_varlen_empty_and_one_token_sequences() -> None:
    cu = torch.tensor([0, 0, 1, 20, 20, 45, 60])
    x = make_inputs(1, 60, 1, 8, 4, HV=2, dtype=F64)
    h0 = make_state(6, 2, 8, 4, dtype=F64)
    o_ref, s_ref = naive_recurrent_kda(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert s_ref is not None
    for fn in (chunk_fwd, recurrent_fwd):
        kw = {"chunk_size": 16} if fn is chunk_fwd else {}
        o, s = fn(**x, scale=8**-0.5, initial_state=h0, cu_seqlens=cu, A_log=None, dt_bias=None, opts=Options(),
                  output_final_state=True, **kw)  # fmt: skip
        assert rel_err(o, o_ref) <= 1e-10
        assert rel_err(s, s_ref) <= 1e-10
        assert torch.equal(s[[0, 3]], h0[[0, 3]])  # empty sequences keep their state


def test_hard_reset_and_zero_gates() -> None:
    """Gates of -1000 (hard reset) and 0 (no decay) must not overflow in the chunkwise form."""
    x = make_inputs(1, 40, 1, 8, 8, dtype=F64)
    g = torch.zeros_like(x["g"])
    g[:, ::7] = -1000.0
    x["g"] = g
    o_ref, _ = naive_recurrent_kda(**x)
    o, _ = chunk_fwd(**x, scale=8**-0.5, initial_state=None, cu_seqlens=None, A_log=None, dt_bias=None,
                     opts=Options(), output_final_state=False, chunk_size=16)  # fmt: skip
    assert torch.isfinite(o).all()
    assert rel_err(o, o_ref) <= 1e-10


def test_option_formulas() -> None:
    x = torch.randn(3, 5, dtype=F64)
    torch.testing.assert_close(l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    raw = torch.randn(4, 2, 3, dtype=F64)
    A, b = torch.randn(2, dtype=F64), torch.randn(6, dtype=F64)
    torch.testing.assert_close(gate(raw, A, b, None), -A.exp()[:, None] * F.softplus(raw + b.view(2, 3)))
    torch.testing.assert_close(gate(raw, A, b, -5.0), -5.0 * torch.sigmoid(A.exp()[:, None] * (raw + b.view(2, 3))))
    torch.testing.assert_close(gate(raw, None, None, -5.0), -5.0 * torch.sigmoid(raw))


OPTION_CASES = {
    "plain": {},
    "l2norm": {"use_qk_l2norm_in_kernel": True},
    "gate": {"use_gate_in_kernel": True},
    "gate_lb": {"use_gate_in_kernel": True, "lower_bound": -5.0},
    "gate_lb_noA": {"use_gate_in_kernel": True, "lower_bound": -5.0, "no_A": True},
    "beta": {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True},
}


@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_bwd_matches_autograd_of_naive(case: str, varlen: bool) -> None:
    kw = dict(OPTION_CASES[case])
    no_A = kw.pop("no_A", False)
    gated = bool(kw.get("use_gate_in_kernel"))
    B, T = (1, 37) if varlen else (2, 21)
    x = make_inputs(B, T, 1, 8, 5, HV=2, dtype=F64, gate_in_kernel=gated,
                    beta_logits=bool(kw.get("use_beta_sigmoid_in_kernel")), seed=3)  # fmt: skip
    if no_A:
        x.pop("A_log")
    cu = torch.tensor([0, 5, 5, 30, 37]) if varlen else None
    N = 4 if varlen else B
    h0 = make_state(N, 2, 8, 5, dtype=F64)
    leaves = {n: t.clone().requires_grad_() for n, t in {**x, "initial_state": h0}.items()}
    o, s = naive_recurrent_kda(**leaves, output_final_state=True, cu_seqlens=cu, **kw)
    assert s is not None
    do, dht = torch.randn_like(o), torch.randn_like(s)
    ref = torch.autograd.grad((o * do).sum() + (s * dht).sum(), list(leaves.values()))
    opts = Options(kw.get("use_qk_l2norm_in_kernel", False), gated, kw.get("use_beta_sigmoid_in_kernel", False),
                   kw.get("allow_neg_eigval", False), kw.get("lower_bound"))  # fmt: skip
    got = chunk_bwd(do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], 8**-0.5, h0, cu, x.get("A_log"),
                    x.get("dt_bias"), opts, chunk_size=16)  # fmt: skip
    named = dict(zip(("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"), got))
    for (name, _), r in zip(leaves.items(), ref):
        gval = named[name]
        assert gval is not None, name
        assert rel_err(gval, r) <= 1e-10, f"d{name}: {rel_err(gval, r):.2e}"
