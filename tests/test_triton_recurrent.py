"""The fused recurrent Triton kernels on the CPU under ``TRITON_INTERPRET=1``, against the float64 oracle.

Every call runs with the ops routed to Triton (``ops.cpu_backend("triton")``) and the launchers' outputs poisoned
with NaN, so an element a kernel forgets to write fails the comparison. Shapes are tiny: the interpreter runs
programs one by one at a few milliseconds per token step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import kda_ops  # noqa: E402
from kda_ops import ops  # noqa: E402
from kda_ops.reference import naive_recurrent_kda  # noqa: E402
from kda_ops.testing import assert_rel, make_inputs, make_state, rel_err  # noqa: E402
from kda_ops.triton import KERNELS  # noqa: E402
from kda_ops.triton import recurrent as tr  # noqa: E402
from kda_ops.triton.debug import poison_outputs  # noqa: E402

pytestmark = pytest.mark.interpret

F64 = torch.float64
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")

# name -> (make_inputs options, public-function options)
OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({}, {}),
    "l2norm": ({}, {"use_qk_l2norm_in_kernel": True}),
    "gate": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True}),
    "gate_no_dt_bias": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True, "dt_bias": None}),
    "lower_bound": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True, "lower_bound": -5.0}),
    "lower_bound_no_A": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True, "lower_bound": -3.0, "A_log": None}),
    "beta_sigmoid": ({"beta_logits": True}, {"use_beta_sigmoid_in_kernel": True}),
    "neg_eigval": ({"beta_logits": True}, {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}),
    "neg_eigval_no_sigmoid": ({}, {"allow_neg_eigval": True}),
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


def _clear_launch_caches() -> None:
    tr.launch_config.cache_clear()
    tr._forward_meta.cache_clear()


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Value tiles of 4: several tiles per head even at V <= 16, so the per-tile partial sums are exercised (the
    launch configuration is cached: the caches are cleared on the way in and out)."""
    monkeypatch.setattr(tr, "BV_MAX", 4)
    _clear_launch_caches()
    yield
    monkeypatch.undo()
    _clear_launch_caches()


def _case(
    name: str, B: int, T: int, H: int, K: int, V: int, HV: int, dtype: torch.dtype, seed: int = 0
) -> dict[str, Any]:
    make_opts, call_opts = OPTIONS[name]
    x = make_inputs(B, T, H, K, V, HV=HV, dtype=dtype, seed=seed, **make_opts)
    x.update(call_opts)
    return x


def _double(x: dict[str, Any]) -> dict[str, Any]:
    return {n: t.double() if isinstance(t, torch.Tensor) else t for n, t in x.items()}


def _run(
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


def _compare(
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
    got = _run(kda_ops.recurrent_kda, x, h0, cu, final, grads, do, dh)
    with ops.cpu_backend("reference"):
        oracle = _run(naive_recurrent_kda, _double(x), None if h0 is None else h0.double(), cu, final, grads, do, dh)
        same_precision = None if tol is not None else _run(kda_ops.recurrent_kda, x, h0, cu, final, grads, do, dh)
    assert got.keys() == oracle.keys()
    for n in got:
        if n[1:] in x:  # a gradient has its input's dtype
            assert got[n].dtype == x[n[1:]].dtype, n
        limit = tol if tol is not None else 2 * rel_err(same_precision[n], oracle[n]) + 1e-6  # type: ignore[index]
        assert_rel(got[n], oracle[n], limit, n)


# ----------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("name", OPTIONS)
def test_forward_every_option(name: str) -> None:
    x = _case(name, 2, 9, 1, 12, 10, HV=2, dtype=torch.float32)
    _compare(x, h0=make_state(2, 2, 12, 10), tol=1e-5)


@pytest.mark.parametrize("name", ["plain", "all"])
def test_forward_fp16(name: str) -> None:
    x = _case(name, 2, 9, 1, 16, 16, HV=2, dtype=torch.float16)
    _compare(x, h0=make_state(2, 2, 16, 16))


def test_forward_fp64_exact() -> None:
    """In float64 the kernel computes in float64: equal to the oracle to rounding."""
    x = _case("all", 1, 8, 1, 12, 10, HV=2, dtype=F64)
    _compare(x, h0=make_state(1, 2, 12, 10, dtype=F64), tol=1e-12)


def test_forward_no_state() -> None:
    x = _case("plain", 2, 6, 1, 8, 8, HV=1, dtype=torch.float32)
    _compare(x, final=False, tol=1e-5)
    o, s = kda_ops.recurrent_kda(**x)
    assert s is None and o.shape == (2, 6, 1, 8)


def test_forward_gva() -> None:
    x = _case("l2norm", 1, 8, 2, 8, 8, HV=4, dtype=torch.float32)
    _compare(x, h0=make_state(1, 4, 8, 8), tol=1e-5)


def test_forward_varlen_empty_sequences() -> None:
    cu = torch.tensor([0, 4, 4, 11, 11], dtype=torch.int32)
    x = _case("gate", 1, 11, 1, 8, 12, HV=1, dtype=torch.float32)
    h0 = make_state(4, 1, 8, 12)
    _compare(x, h0=h0, cu=cu, tol=1e-5)
    _, s = kda_ops.recurrent_kda(**x, initial_state=h0, cu_seqlens=cu, output_final_state=True)
    assert s is not None
    torch.testing.assert_close(s[1], h0[1], rtol=0, atol=0)  # empty sequences keep their initial state
    torch.testing.assert_close(s[3], h0[3], rtol=0, atol=0)


def test_forward_tiled_values(small_tiles: None) -> None:
    x = _case("all", 2, 7, 1, 12, 10, HV=2, dtype=torch.float32)
    _compare(x, h0=make_state(2, 2, 12, 10), tol=1e-5)


def test_forward_extreme_gates() -> None:
    """A hard reset (g = -1000) and no decay (g = 0): nothing overflows, nothing leaks."""
    x = _case("plain", 1, 10, 1, 8, 8, HV=2, dtype=torch.float32)
    x["g"][:, 3] = -1000.0
    x["g"][:, 6:] = 0.0
    _compare(x, h0=make_state(1, 2, 8, 8), tol=1e-5)


def test_kernel_entry_matches_reference_kernel() -> None:
    """``KERNELS["recurrent"]`` has the reference kernel's signature and results."""
    from kda_ops import reference
    from kda_ops.common import Options

    x = make_inputs(2, 5, 1, 8, 8, HV=2)
    opts = Options(use_qk_l2norm=True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, make_state(2, 2, 8, 8), None, None, None, opts, True)
    o, s = KERNELS["recurrent"](*args)
    o_ref, s_ref = reference.recurrent_fwd(*args)
    assert_rel(o, o_ref, 1e-6)
    assert_rel(s, s_ref, 1e-6)
    o, s = KERNELS["recurrent"](*args[:-1], False)
    assert s.shape == (0,)


# ---------------------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("name", OPTIONS)
def test_gradients_every_option(name: str) -> None:
    x = _case(name, 2, 9, 1, 12, 10, HV=2, dtype=torch.float32)
    _compare(x, h0=make_state(2, 2, 12, 10), grads=True, tol=1e-5)


def test_gradients_fp16() -> None:
    x = _case("all", 1, 8, 1, 16, 16, HV=2, dtype=torch.float16)
    _compare(x, h0=make_state(1, 2, 16, 16), grads=True)


def test_gradients_fp64_exact() -> None:
    x = _case("all", 1, 9, 1, 8, 6, HV=2, dtype=F64)
    _compare(x, h0=make_state(1, 2, 8, 6, dtype=F64), grads=True, tol=1e-11)


def test_gradients_without_state() -> None:
    """No initial state, no final state (so no final-state gradient)."""
    x = _case("gate", 2, 9, 1, 8, 8, HV=1, dtype=torch.float32)
    _compare(x, final=False, grads=True, tol=1e-5)


def test_gradients_final_state_without_its_gradient() -> None:
    x = _case("plain", 2, 9, 1, 8, 8, HV=1, dtype=torch.float32)
    _compare(x, h0=make_state(2, 1, 8, 8), grads=True, dht=False, tol=1e-5)


def test_gradients_gva() -> None:
    x = _case("all", 1, 9, 2, 8, 8, HV=4, dtype=torch.float32)
    _compare(x, h0=make_state(1, 4, 8, 8), grads=True, tol=1e-5)


def test_gradients_varlen_empty_sequences() -> None:
    cu = torch.tensor([0, 0, 9, 9, 14], dtype=torch.int64)
    x = _case("all", 1, 14, 1, 8, 8, HV=1, dtype=torch.float32)
    _compare(x, h0=make_state(4, 1, 8, 8), cu=cu, grads=True, tol=1e-5)


def test_gradients_tiled_values(small_tiles: None) -> None:
    x = _case("all", 1, 9, 1, 12, 10, HV=2, dtype=torch.float32)
    _compare(x, h0=make_state(1, 2, 12, 10), grads=True, tol=1e-5)


def test_gradients_long_sequence_many_checkpoints() -> None:
    """T = 32 (B = 1): checkpoint interval 8, so four segments are recomputed and walked backwards."""
    x = _case("gate", 1, 32, 1, 8, 8, HV=1, dtype=torch.float32)
    _compare(x, h0=make_state(1, 1, 8, 8), grads=True, tol=1e-5)


def test_gradients_extreme_gates() -> None:
    x = _case("plain", 1, 12, 1, 8, 8, HV=2, dtype=torch.float32)
    x["g"][:, 2] = -1000.0
    x["g"][:, 7:] = 0.0
    _compare(x, h0=make_state(1, 2, 8, 8), grads=True, tol=1e-5)
