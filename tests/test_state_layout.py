"""The V-first state layout (``state_v_first=True``: states ``[N, HV, V, K]``, the layout of vLLM's and SGLang's
pools): every state in and out of every op, and its gradient, equal bit for bit to the K-first result transposed,
on the reference and on the Triton kernels under the interpreter; the serving pool updated in place in its layout;
the ops' opcheck with the option; errors for a state shaped for the other layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kda_ops
from kda_ops import ops
from kda_ops.testing import make_inputs, make_state

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.interpret)]
SCHEDULES: dict[str, Callable[..., Any]] = {"chunk": kda_ops.chunk_kda, "recurrent": kda_ops.recurrent_kda}
# K != V, so that a state read in the wrong layout cannot pass for the right one; HV = 2 H (grouped value heads)
H, HV, K, V = 1, 2, 8, 16
CU = [0, 30, 30, 100]  # packed: an empty sequence, one longer than a chunk
# the per-token schedule has no chunk to cross: shorter sequences (its kernel runs each token under the interpreter)
CU_TOKENWISE = [0, 9, 9, 24]


def vf(x: torch.Tensor) -> torch.Tensor:
    """A K-first state tensor in the V-first layout (or back)."""
    return x.transpose(-1, -2).contiguous()


def batch(packed: bool, tokenwise: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, int]:
    """Inputs (gate and beta sigmoid in kernel), ``cu_seqlens`` and the number of sequences."""
    cu_list = CU_TOKENWISE if tokenwise else CU
    B, T = (1, cu_list[-1]) if packed else (2, 20 if tokenwise else 70)
    x = make_inputs(B, T, H, K, V, HV=HV, gate_in_kernel=True, beta_logits=True)
    cu = torch.tensor(cu_list) if packed else None
    return x, cu, len(cu_list) - 1 if packed else B


def options(x: dict[str, torch.Tensor]) -> dict[str, Any]:
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x.pop("A_log"),
                dt_bias=x.pop("dt_bias"), use_beta_sigmoid_in_kernel=True)  # fmt: skip


def run(fn: Callable[..., Any], x: dict[str, torch.Tensor], h0: torch.Tensor | None, cu: torch.Tensor | None,
        v_first: bool, dst: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Forward and backward of one call: ``(o, final, grads of q, k, v, g, beta, A_log, dt_bias[, h0])``, the
    final-state gradient ``dst`` given K-first and passed in the call's layout."""
    inputs = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    opts = options(inputs)
    leaves = [*inputs.values(), opts["A_log"], opts["dt_bias"]]
    state = None
    if h0 is not None:
        state = (vf(h0) if v_first else h0.clone()).requires_grad_()
        leaves.append(state)
    o, s = fn(**inputs, **opts, initial_state=state, output_final_state=True, cu_seqlens=cu, state_v_first=v_first,
              **kw)  # fmt: skip
    do = torch.linspace(-1, 1, o.numel()).view_as(o)
    torch.autograd.backward((o, s), (do, vf(dst) if v_first else dst))
    grads = [t.grad for t in leaves]
    assert all(t is not None for t in grads)
    return (o.detach(), s.detach(), *grads)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h0", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("schedule", ["chunk", "chunk_recompute", "recurrent"])
def test_v_first_is_k_first_transposed(schedule: str, packed: bool, h0: bool, backend: str) -> None:
    """Outputs, final state and every gradient (the initial state's transposed) equal bit for bit."""
    fn = SCHEDULES[schedule.split("_")[0]]
    kw = {"recompute_in_backward": True} if schedule == "chunk_recompute" else {}
    x, cu, N = batch(packed, tokenwise=schedule == "recurrent")
    state = make_state(N, HV, K, V) if h0 else None
    dst = make_state(N, HV, K, V, seed=2)
    with ops.cpu_backend(backend):
        k_first = run(fn, x, state, cu, False, dst, **kw)
        v_first = run(fn, x, state, cu, True, dst, **kw)
    assert v_first[1].shape == (N, HV, V, K)
    assert torch.equal(v_first[0], k_first[0])
    assert torch.equal(v_first[1], vf(k_first[1]))
    for a, b in zip(v_first[2:9], k_first[2:9]):
        assert torch.equal(a, b)
    if h0:
        assert v_first[9].shape == (N, HV, V, K)
        assert torch.equal(v_first[9], vf(k_first[9]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_intermediate_states_follow_the_layout(packed: bool, backend: str) -> None:
    x, cu, N = batch(packed)
    opts = options(x)
    h0 = make_state(N, HV, K, V)
    with ops.cpu_backend(backend), torch.no_grad():
        o, s, h = kda_ops.chunk_kda(**x, **opts, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    return_intermediate_states=True)  # fmt: skip
        o_v, s_v, h_v = kda_ops.chunk_kda(**x, **opts, initial_state=vf(h0), output_final_state=True, cu_seqlens=cu,
                                          return_intermediate_states=True, state_v_first=True)  # fmt: skip
    assert s is not None and s_v is not None
    assert h_v.shape == (*h.shape[:-2], V, K) and h_v.is_contiguous()
    assert torch.equal(o_v, o) and torch.equal(s_v, vf(s)) and torch.equal(h_v, vf(h))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["decode", "dense", "packed"])
def test_serving_pool_v_first_in_place(shape: str, backend: str) -> None:
    """The pool ``[S, HV, V, K]`` updated in place (same storage), as the K-first pool transposed; the slots no
    sequence names, and those of padding sequences (-1), untouched."""
    B, T, cu = {"decode": (3, 1, None), "dense": (3, 4, None), "packed": (1, 9, torch.tensor([0, 2, 7, 9]))}[shape]
    x = make_inputs(B, T, H, K, V, HV=HV, gate_in_kernel=True, beta_logits=True)
    opts = options(x)
    pool = make_state(5, HV, K, V)
    pool_v = vf(pool)
    before = pool_v.clone()
    ptr = pool_v.data_ptr()
    slots = torch.tensor([3, -1, 0])
    with ops.cpu_backend(backend), torch.no_grad():
        o = kda_ops.recurrent_kda_update_(**x, **opts, state_pool=pool, state_indices=slots, cu_seqlens=cu)
        o_v = kda_ops.recurrent_kda_update_(**x, **opts, state_pool=pool_v, state_indices=slots, cu_seqlens=cu,
                                            state_v_first=True)  # fmt: skip
    assert pool_v.data_ptr() == ptr
    assert torch.equal(o_v, o)
    assert torch.equal(pool_v, vf(pool))
    for slot in (1, 2, 4):
        assert torch.equal(pool_v[slot], before[slot])
    assert not torch.equal(pool_v[3], before[3]) and not torch.equal(pool_v[0], before[0])


def _op_args(x: dict[str, torch.Tensor], h0: torch.Tensor, cu: torch.Tensor) -> tuple[Any, ...]:
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], K**-0.5, h0, cu, x["A_log"], x["dt_bias"], None, True, True,
            True, True, False, True)  # fmt: skip


@pytest.mark.parametrize("op", ["chunk", "chunk_states", "recurrent"])
def test_opcheck_forward_v_first(op: str) -> None:
    x = make_inputs(1, 12, H, K, V, HV=HV, gate_in_kernel=True, beta_logits=True)
    x = {n: t.requires_grad_() for n, t in x.items()} if op != "chunk_states" else x
    h0 = vf(make_state(3, HV, K, V))
    if op != "chunk_states":
        h0.requires_grad_()
    torch.library.opcheck(getattr(torch.ops.kda, op).default, _op_args(x, h0, torch.tensor([0, 3, 3, 12])))


@pytest.mark.parametrize("op", ["chunk_bwd", "recurrent_bwd"])
def test_opcheck_backward_v_first(op: str) -> None:
    x = make_inputs(1, 12, H, K, V, HV=HV, gate_in_kernel=True, beta_logits=True)
    h0, dht = vf(make_state(2, HV, K, V)), vf(make_state(2, HV, K, V, seed=2))
    args = (torch.randn_like(x["v"]), dht, x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, h0, torch.tensor([0, 5, 12]),
            x["A_log"], x["dt_bias"], None, True, True, True, True, True)  # fmt: skip
    torch.library.opcheck(getattr(torch.ops.kda, op).default, args)


def test_opcheck_serving_v_first() -> None:
    x = make_inputs(3, 1, H, K, V, HV=HV, gate_in_kernel=True, beta_logits=True)
    pool = vf(make_state(4, HV, K, V))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], pool, torch.tensor([2, -1, 0]), 0.5, None, x["A_log"],
            x["dt_bias"], None, True, True, True, False, True)  # fmt: skip
    torch.library.opcheck(torch.ops.kda.recurrent_update_.default, args)


def test_fake_shapes_v_first() -> None:
    x = {n: t.to("meta") for n, t in make_inputs(2, 5, H, K, V, HV=HV).items()}
    _, s = torch.ops.kda.chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, None, None, None, None, None, True,
                               False, False, False, False, True)  # fmt: skip
    assert s.shape == (2, HV, V, K)
    _, _, h = torch.ops.kda.chunk_states(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, None, None, None, None,
                                         None, True, False, False, False, False, True)  # fmt: skip
    assert h.shape == (2, 1, HV, V, K)


@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_state_of_the_other_layout_is_refused(schedule: str, v_first: bool) -> None:
    x = make_inputs(2, 3, H, K, V, HV=HV)
    wrong = make_state(2, HV, K, V)
    wrong = wrong if v_first else vf(wrong)
    layout = r"\[N, HV, V, K\] \(the V-first" if v_first else r"\[N, HV, K, V\] \(the K-first"
    with pytest.raises(ValueError, match=rf"initial_state: expected shape {layout}"):
        SCHEDULES[schedule](**x, initial_state=wrong, state_v_first=v_first)


@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
def test_pool_of_the_other_layout_is_refused(v_first: bool) -> None:
    x = make_inputs(2, 1, H, K, V, HV=HV)
    pool = make_state(4, HV, K, V)
    pool = pool if v_first else vf(pool)
    layout = r"\[S, HV, V, K\] \(the V-first" if v_first else r"\[S, HV, K, V\] \(the K-first"
    with pytest.raises(ValueError, match=rf"state_pool: expected shape {layout}"):
        kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=torch.tensor([0, 1]), state_v_first=v_first)


def test_state_v_first_must_be_a_bool() -> None:
    x = make_inputs(1, 3, H, K, V, HV=HV)
    with pytest.raises(TypeError, match="state_v_first: expected a bool"):
        kda_ops.chunk_kda(**x, state_v_first="yes")  # type: ignore[arg-type]
