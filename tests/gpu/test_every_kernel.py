"""Every Triton kernel and launch form once, on small shapes, against the float64 recurrence: the set that ``nox -s
sanitize`` runs under compute-sanitizer (memcheck, racecheck), and a GPU test on its own.

Each chunk case runs the forward and the backward through both saved-factor paths (the training pair and the
recompute); together they reach the anchored and the block prepare passes (hard resets, a lower bound), the
unsplit and the split scans forward and reverse, both output forms, K = V = 16, 64, 100 / 72, 128 and 256, packed
rows with empty sequences, grouped value heads, 32- and 16-bit inputs, the V-first layout and the per-chunk states.
The recurrent cases run the per-token forward and backward; the serving cases the pool step (padding slots,
speculative slots, fp32 and bf16 pools, V-first) and the chunked prefill into the pool with checkpoints. Bounds
are loose (the precise ones are the other GPU files'): what this file adds is that every form runs and is right.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

import kda_ops  # noqa: E402
from kda_ops.reference import naive_recurrent_kda  # noqa: E402
from kda_ops.testing import make_inputs, make_state, rel_err  # noqa: E402
from kda_ops.triton.launch import force_forms  # noqa: E402
from tests.cases import OPTIONS, hard_reset, unit_qk  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
TOL = {F32: 1e-3, F16: 2e-2, BF16: 3e-2}
CU = [0, 0, 70, 70, 200]  # an empty sequence first and inside, a partial chunk, four chunk slots' worth
CU_SPLIT = [0, 448, 448, 640, 670]

# (id, dtype, K, V, option, HV / H, packed, gates, forms)
CHUNK_CASES = [
    ("fp32-K16-resets", F32, 16, 16, "plain", 1, True, "reset", {}),
    ("bf16-K64-all-gva", BF16, 64, 64, "all", 2, True, "normal", {}),
    ("bf16-K100-V72-l2norm", BF16, 100, 72, "l2norm", 1, False, "normal", {}),
    ("bf16-K128-gate-resets", BF16, 128, 128, "gate", 1, True, "reset", {}),
    ("fp16-K64-lower-bound", F16, 64, 64, "lower_bound", 1, True, "normal", {}),
    ("bf16-K256-l2norm", BF16, 256, 256, "l2norm", 1, True, "normal", {}),
    ("bf16-K128-split-scans", BF16, 128, 128, "l2norm", 1, True, "normal", {"scan_segments": 4}),
    ("bf16-K128-output-per-item", BF16, 128, 128, "l2norm", 1, False, "normal", {"output_per_item": True}),
    ("bf16-K128-output-per-sm", BF16, 128, 128, "l2norm", 1, False, "normal", {"output_per_item": False}),
]


def _inputs(dtype: torch.dtype, K: int, V: int, option: str, group: int, cu_list: list[int] | None,
            gates: str) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor | None]:  # fmt: skip
    """Inputs (H = 2, HV = 2 * group; ``cu_list`` packed, else B2 T130), the call's options, ``cu_seqlens``."""
    make_opts, call_opts = OPTIONS[option]
    B, T = (1, cu_list[-1]) if cu_list is not None else (2, 130)
    x = make_inputs(B, T, 2, K, V, HV=2 * group, dtype=dtype, device=DEV, seed=1, **make_opts)
    if not call_opts.get("use_qk_l2norm_in_kernel", False):
        unit_qk(x)
    if gates == "reset":
        hard_reset(x["g"], (3, 64, 65, 100), T // 3)
    cu = torch.tensor(cu_list, device=DEV) if cu_list is not None else None
    kw = {n: call_opts.get(n, x[n]) for n in ("A_log", "dt_bias") if n in x}
    kw.update({n: v for n, v in call_opts.items() if n not in ("A_log", "dt_bias")})
    return {n: x[n] for n in ("q", "k", "v", "g", "beta")}, kw, cu


def _check(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float) -> None:
    errs = {n: rel_err(got[n], ref[n]) for n in ref}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"over {tol}: {bad} (all: {errs})"


def _run(fn: Any, leaves: dict[str, torch.Tensor], kw: dict[str, Any], h0: torch.Tensor, grad: bool,
         cot: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:  # fmt: skip
    xs = {n: t.detach().clone().requires_grad_(grad) for n, t in leaves.items()}
    s0 = h0.detach().clone().requires_grad_(grad)
    o, s = fn(**xs, initial_state=s0, output_final_state=True, **kw)
    out = {"o": o.detach(), "state": s.detach()}
    if grad:
        torch.autograd.backward((o, s), (cot[0].to(o.dtype), cot[1].to(s.dtype)))
        out.update({"d" + n: t.grad for n, t in xs.items() if t.grad is not None})
        assert s0.grad is not None
        out["dh0"] = s0.grad
    return out


@contextlib.contextmanager
def _forms(forms: dict[str, Any]) -> Iterator[None]:
    with force_forms(**forms) if forms else contextlib.nullcontext():
        yield


def _oracle(leaves: dict[str, torch.Tensor], kw: dict[str, Any], h0: torch.Tensor, cu: torch.Tensor | None,
            cot: tuple[torch.Tensor, torch.Tensor], grad: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    # on the CPU: the per-token loop is thousands of tiny launches on the GPU, each one slow under the sanitizer
    d = {n: t.to("cpu", F64) for n, t in leaves.items()}
    kd = {n: (v.to("cpu", F64) if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
    cu_cpu = cu.cpu() if cu is not None else None
    out = _run(naive_recurrent_kda, d, {**kd, "cu_seqlens": cu_cpu}, h0.to("cpu", F64), grad,
               (cot[0].cpu(), cot[1].cpu()))  # fmt: skip
    return {n: t.to(DEV) for n, t in out.items()}


@pytest.mark.parametrize("case", CHUNK_CASES, ids=[c[0] for c in CHUNK_CASES])
def test_chunk_forward_and_both_backwards(case: tuple[Any, ...]) -> None:
    _, dtype, K, V, option, group, packed, gates, forms = case
    cu_list = (CU_SPLIT if "scan_segments" in forms else CU) if packed else None
    leaves, kw, cu = _inputs(dtype, K, V, option, group, cu_list, gates)
    N = cu.numel() - 1 if cu is not None else 2
    HV = leaves["v"].shape[2]
    h0 = make_state(N, HV, K, V, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(9)
    cot = (torch.randn(leaves["v"].shape, generator=gen, device=DEV), torch.randn(h0.shape, generator=gen,
                                                                                    device=DEV))  # fmt: skip
    ref = _oracle(leaves, kw, h0, cu, cot)
    for recompute in (False, True):
        with _forms(forms):
            got = _run(kda_ops.chunk_kda, leaves, {**kw, "cu_seqlens": cu, "recompute_in_backward": recompute}, h0,
                       True, cot)  # fmt: skip
        _check(got, ref, TOL[dtype])


def test_chunk_v_first_and_per_chunk_states() -> None:
    """The V-first layout's forward (no grad) and the per-chunk states: the states' last row per sequence is its
    final state, transposed from the K-first call's."""
    leaves, kw, cu = _inputs(BF16, 128, 128, "l2norm", 1, CU, "normal")
    h0 = make_state(4, 2, 128, 128, device=DEV)
    with torch.no_grad():
        o, s = kda_ops.chunk_kda(**leaves, **kw, cu_seqlens=cu, initial_state=h0, output_final_state=True)
        o_v, s_v, mids = kda_ops.chunk_kda(**leaves, **kw, cu_seqlens=cu, initial_state=h0.transpose(-1, -2)
                                           .contiguous(), output_final_state=True, state_v_first=True,
                                           return_intermediate_states=True)  # fmt: skip
    assert s is not None and s_v is not None
    assert rel_err(o_v, o) < 1e-2 and rel_err(s_v.transpose(-1, -2), s) < 1e-2
    assert torch.isfinite(mids).all()


@pytest.mark.parametrize(("dtype", "K", "option"), [(BF16, 128, "all"), (F32, 64, "gate"), (BF16, 256, "l2norm")],
                         ids=["bf16-K128-all", "fp32-K64-gate", "bf16-K256-l2norm"])  # fmt: skip
def test_recurrent_forward_and_backward(dtype: torch.dtype, K: int, option: str) -> None:
    leaves, kw, cu = _inputs(dtype, K, K, option, 2, CU, "normal")
    h0 = make_state(4, 4, K, K, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(9)
    cot = (torch.randn(leaves["v"].shape, generator=gen, device=DEV), torch.randn(h0.shape, generator=gen,
                                                                                    device=DEV))  # fmt: skip
    ref = _oracle(leaves, kw, h0, cu, cot)
    got = _run(kda_ops.recurrent_kda, leaves, {**kw, "cu_seqlens": cu}, h0, True, cot)
    _check(got, ref, TOL[dtype])


@pytest.mark.parametrize("pool_dtype", [F32, BF16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize("v_first", [False, True], ids=["k-first", "v-first"])
def test_serving_steps(pool_dtype: torch.dtype, v_first: bool) -> None:
    """The pool step with a padding slot, a speculative step with 2-D slots, and the chunked prefill into the pool
    with checkpoints: outputs against the oracle from the gathered states, padding slots and untouched rows of the
    pool equal bit for bit."""
    H, D, S = 2, 128, 12

    def pool_of(states: torch.Tensor) -> torch.Tensor:
        return (states.transpose(-1, -2) if v_first else states).contiguous().to(pool_dtype)

    def k_first(p: torch.Tensor) -> torch.Tensor:
        return (p.transpose(-1, -2) if v_first else p).float()

    pool0 = pool_of(make_state(S, H, D, D, device=DEV))
    opts = {"use_qk_l2norm_in_kernel": True, "state_v_first": v_first}
    # decode: 3 sequences, the middle one padding
    x = make_inputs(3, 1, H, D, D, dtype=BF16, device=DEV, seed=2)
    idx = torch.tensor([4, -1, 7], device=DEV)
    p = pool0.clone()
    o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=idx, **opts)
    o_ref, s_ref = naive_recurrent_kda(**{n: t.to(F64) for n, t in x.items()}, use_qk_l2norm_in_kernel=True,
                                       initial_state=k_first(pool0[idx.clamp(min=0)]).to(F64),
                                       output_final_state=True)  # fmt: skip
    assert s_ref is not None
    keep = torch.tensor([0, 2], device=DEV)
    assert rel_err(o[keep], o_ref[keep]) < 2e-2 and torch.equal(o[1], torch.zeros_like(o[1]))
    assert rel_err(k_first(p[idx[keep]]), s_ref[keep]) < 2e-2
    rest = torch.ones(S, dtype=torch.bool, device=DEV)
    rest[idx[keep]] = False
    assert torch.equal(p[rest], pool0[rest])
    # a speculative step of 3 draft tokens, one slot column skipped, then the next step from the accepted tokens
    xs = make_inputs(2, 3, H, D, D, dtype=BF16, device=DEV, seed=3)
    slots = torch.tensor([[0, 1, 2], [3, -1, 5]], device=DEV)
    p = pool0.clone()
    o = kda_ops.recurrent_kda_update_(**xs, state_pool=p, state_indices=slots, **opts)
    o_ref, _ = naive_recurrent_kda(**{n: t.to(F64) for n, t in xs.items()}, use_qk_l2norm_in_kernel=True,
                                   initial_state=k_first(pool0[slots[:, 0]]).to(F64))  # fmt: skip
    assert rel_err(o, o_ref) < 2e-2 and torch.equal(p[4], pool0[4])
    kda_ops.recurrent_kda_update_(**make_inputs(2, 2, H, D, D, dtype=BF16, device=DEV, seed=4), state_pool=p,
                                  state_indices=slots, num_accepted_tokens=torch.tensor([2, 1], device=DEV), **opts)
    assert torch.isfinite(p.float()).all()
    # chunked prefill into the pool: 2 sequences (one padding), checkpoints every 64 tokens
    if pool_dtype == F32:
        xp = make_inputs(2, 150, H, D, D, dtype=BF16, device=DEV, seed=5)
        p = pool0.clone()
        ckpt = torch.tensor([[8, 9], [10, 11]], device=DEV)
        o = kda_ops.chunk_kda_update_(**xp, state_pool=p, state_indices=torch.tensor([0, -1], device=DEV),
                                      checkpoint_every=64, checkpoint_indices=ckpt, **opts)  # fmt: skip
        o_ref, s_ref = naive_recurrent_kda(**{n: t[:1].to(F64) for n, t in xp.items()}, use_qk_l2norm_in_kernel=True,
                                           initial_state=k_first(pool0[:1]).to(F64), output_final_state=True)
        assert s_ref is not None
        assert rel_err(o[:1], o_ref) < 2e-2 and rel_err(k_first(p[:1]), s_ref) < 2e-2
        assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(p[1:8], pool0[1:8])
        assert torch.isfinite(p[8:10]).all() and torch.equal(p[10:], pool0[10:])


def test_gate_op() -> None:
    g = torch.randn(1, 70, 2, 64, device=DEV, requires_grad=True)
    A_log = torch.randn(2, device=DEV, requires_grad=True)
    dt_bias = torch.randn(128, device=DEV, requires_grad=True)
    out = kda_ops.kda_gate(g, A_log, dt_bias, lower_bound=-5.0)
    out.sum().backward()
    assert torch.isfinite(out).all() and g.grad is not None and torch.isfinite(g.grad).all()
