"""``kda_ops.reference.chunk.backward``: the analytic chunkwise backward against autograd of the naive recurrence,
in float64, for every in-kernel option, dense and packed."""

from __future__ import annotations

import pytest
import torch

from kda_ops.reference import chunk_bwd, naive_recurrent_kda
from kda_ops.testing import make_inputs, make_state, rel_err
from tests.cases import CU_REFERENCE_BWD, F64, OPTIONS, REFERENCE_BWD_OPTIONS, options


@pytest.mark.parametrize("case", REFERENCE_BWD_OPTIONS)
@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_bwd_matches_autograd_of_naive(case: str, varlen: bool) -> None:
    make_opts, call_opts = OPTIONS[case]
    absent = [name for name, value in call_opts.items() if value is None]  # A_log or dt_bias left out
    kw = {name: value for name, value in call_opts.items() if value is not None}
    B, T = (1, 37) if varlen else (2, 21)
    x = make_inputs(B, T, 1, 8, 5, HV=2, dtype=F64, seed=3, **make_opts)
    for name in absent:
        x.pop(name)
    cu = torch.tensor(CU_REFERENCE_BWD) if varlen else None
    N = 4 if varlen else B
    h0 = make_state(N, 2, 8, 5, dtype=F64)
    leaves = {n: t.clone().requires_grad_() for n, t in {**x, "initial_state": h0}.items()}
    o, s = naive_recurrent_kda(**leaves, output_final_state=True, cu_seqlens=cu, **kw)
    assert s is not None
    do, dht = torch.randn_like(o), torch.randn_like(s)
    ref = torch.autograd.grad((o * do).sum() + (s * dht).sum(), list(leaves.values()))
    got = chunk_bwd(do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], 8**-0.5, h0, cu, x.get("A_log"),
                    x.get("dt_bias"), options(call_opts), chunk_size=16)  # fmt: skip
    named = dict(zip(("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"), got))
    for (name, _), r in zip(leaves.items(), ref):
        gval = named[name]
        assert gval is not None, name
        assert rel_err(gval, r) <= 1e-10, f"d{name}: {rel_err(gval, r):.2e}"
