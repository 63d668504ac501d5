"""The chunkwise Triton backward on the GPU: bf16 gradients against the float64 oracle, variable length,
grouped value heads, every option, hard resets, opcheck, no host synchronisation.

The oracle is the analytic reference backward (``kda_ops.reference.chunk_bwd``) on float64 CUDA copies of the
same (bf16-rounded) inputs; it equals autograd of the naive recurrence to ~1e-15
(``tests/reference/chunk/test_backward.py``). The Triton backward runs twice: once to compile and autotune, then
with host syncs raising and every launcher's buffers poisoned with NaN. Bounds: dq, dk, dv, dh0 <= 8e-3;
dg, dbeta <= 2e-2 (relative).

The compiled two-layer training step (loss equal to eager, decreasing over 50 steps, 0 graph breaks) is
``tests/gpu/test_models_gpu.py``: its model's layers call ``kda_ops.chunk_kda``, whose backward is this one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kda_ops
from kda_ops import ops, reference
from kda_ops.common import Options
from kda_ops.testing import make_inputs, make_state, rel_err
from tests._gpu_checks import checked
from tests.cases import (
    BF16,
    CHUNK_BWD_GPU_OPTIONS,
    CHUNK_GRAD_TOL,
    CU_GPU_BWD,
    F64,
    OPTIONS,
    hard_reset,
    options,
    set_gates,
    unit_qk,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = CHUNK_GRAD_TOL
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")


def _run(name: str, B: int, T: int, H: int, HV: int, gates: str = "normal", cu: list[int] | None = None,
         dtype: torch.dtype = BF16, K: int = 128, V: int = 128) -> dict[str, float]:  # fmt: skip
    """Relative errors of the Triton backward's gradients against the float64 oracle."""
    make_opts, call_opts = OPTIONS[name]
    x = make_inputs(B, T, H, K, V, HV=HV, dtype=dtype, device=DEV, seed=1, **make_opts)
    if not call_opts.get("use_qk_l2norm_in_kernel", False):  # long keys make the solve ill-conditioned
        unit_qk(x)
    if gates == "reset":
        hard_reset(x["g"], (3, 64, 65, 500), T // 3)
    elif gates == "zero":
        set_gates(x["g"], "zero")
    A_log = call_opts.get("A_log", x.get("A_log"))
    dt_bias = call_opts.get("dt_bias", x.get("dt_bias"))
    cu_t = None if cu is None else torch.tensor(cu, device=DEV, dtype=torch.int32)
    n = B if cu is None else len(cu) - 1
    h0 = make_state(n, HV, K, V, device=DEV)
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(x["v"].shape, generator=gen).to(DEV, dtype)
    dht = torch.randn(h0.shape, generator=gen).to(DEV)
    args = (do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], K**-0.5, h0, cu_t, A_log, dt_bias, options(call_opts))
    from kda_ops.triton import KERNELS

    KERNELS["chunk_bwd"](*args)  # compile and autotune
    with checked():
        got = KERNELS["chunk_bwd"](*args)

    def d(t: Any) -> Any:
        return t.to(F64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    ref = reference.chunk_bwd(*(d(t) for t in args))
    errs = {}
    for nm, a, b in zip(NAMES, got, ref):
        assert (a is None) == (b is None), nm
        if a is not None:
            errs[nm] = rel_err(a, b)
    return errs


def _check(errs: dict[str, float]) -> None:
    bad = {n: e for n, e in errs.items() if not e <= TOL[n]}
    assert not bad, f"errors over the bounds: {bad} (all: {errs})"


@pytest.mark.parametrize("T", [64, 1000, 4096])
def test_lengths_bf16(T: int) -> None:
    _check(_run("l2norm", 1, T, 4, 4))


def test_varlen_gva_empty_and_one_token() -> None:
    _check(_run("all", 1, 1000, 2, 4, cu=CU_GPU_BWD))


@pytest.mark.parametrize("name", CHUNK_BWD_GPU_OPTIONS)
def test_every_option(name: str) -> None:
    _check(_run(name, 2, 300, 2, 4))


@pytest.mark.parametrize("gates", ["reset", "zero"])
def test_extreme_gates(gates: str) -> None:
    _check(_run("l2norm", 1, 1000, 2, 2, gates=gates))


def test_fp32_tight() -> None:
    errs = _run("all", 1, 500, 2, 4, dtype=torch.float32)
    assert all(e <= 1e-3 for e in errs.values()), errs


@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_chunk_with_grad(varlen: bool) -> None:
    assert "chunk_bwd" in ops.TRITON_KERNELS
    x = make_inputs(1 if varlen else 2, 80, 2, 32, 32, HV=4, dtype=BF16, device=DEV, gate_in_kernel=True)
    x = {n: t.requires_grad_() if t.is_floating_point() else t for n, t in x.items()}
    cu = torch.tensor([0, 10, 10, 80], device=DEV) if varlen else None
    h0 = make_state(3 if varlen else 2, 4, 32, 32, device=DEV).requires_grad_()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, h0, cu, x["A_log"], x["dt_bias"], None, True, True, True,
            False, False)  # fmt: skip
    torch.library.opcheck(torch.ops.kda.chunk.default, args)
    # the training pair: the forward that keeps its factors, and the backward that reads them
    torch.library.opcheck(ops.chunk_train, args)
    with torch.no_grad():
        out = ops.chunk_train(*args)
    plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args[:10])
    flags = args[10:11] + args[12:]
    do, dht = torch.randn_like(out[0]), torch.randn_like(out[1])
    torch.library.opcheck(ops.chunk_bwd_saved, (do, dht, *plain, *out[2:], *flags))


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_autograd_through_chunk_kda_matches_oracle(recompute: bool) -> None:
    """The public function's autograd path on CUDA (kda::chunk_train -> kda::chunk_bwd_saved, or with
    recompute_in_backward kda::chunk -> kda::chunk_bwd) against the oracle."""
    x = make_inputs(1, 700, 2, 64, 64, HV=4, dtype=BF16, device=DEV, beta_logits=True)
    xs = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = kda_ops.chunk_kda(**xs, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             output_final_state=True, recompute_in_backward=recompute)  # fmt: skip
    assert s is not None
    with torch.no_grad():  # the forward op of inference on the same inputs
        o_inf, s_inf = kda_ops.chunk_kda(**x, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                         output_final_state=True)  # fmt: skip
    assert s_inf is not None
    assert rel_err(o.detach(), o_inf) <= 5e-3 and rel_err(s.detach(), s_inf) <= 5e-3
    do = torch.randn_like(o)
    (o * do).sum().backward()
    ref = reference.chunk_bwd(do.double(), None, *(x[n].double() for n in ("q", "k", "v", "g", "beta")), 64**-0.5,
                              None, None, None, None, Options(True, False, True, False, None))  # fmt: skip
    for nm, r in zip(("q", "k", "v", "g", "beta"), ref):
        grad = xs[nm].grad
        assert grad is not None and r is not None
        assert rel_err(grad, r) <= TOL["d" + nm], nm


@pytest.mark.parametrize("cu", [None, [0, 100, 300, 1200, 3000, 4096]], ids=["dense", "packed"])
@pytest.mark.parametrize("dtype", [torch.float16, BF16], ids=["fp16", "bf16"])
def test_training_pair_at_head_dim_256(dtype: torch.dtype, cu: list[int] | None) -> None:
    """The training pair's backward at K = V = 256 in 16-bit (its reverse scan holds [256, BV] tiles: they must fit
    the card's shared memory) against the oracle, dense and packed."""
    x = make_inputs(1, 4096, 4, 256, 256, dtype=dtype, device=DEV, seed=3)
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    xs = {n: t.clone().requires_grad_() for n, t in x.items() if n in ("q", "k", "v", "g", "beta")}
    o, _ = kda_ops.chunk_kda(**xs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    ref = reference.chunk_bwd(do.double(), None, *(x[n].double() for n in ("q", "k", "v", "g", "beta")), 256**-0.5,
                              None, cu_t, None, None, Options(use_qk_l2norm=True))  # fmt: skip
    for nm, r in zip(("q", "k", "v", "g", "beta"), ref):
        grad = xs[nm].grad
        assert grad is not None and r is not None
        assert rel_err(grad, r) <= TOL["d" + nm], nm
