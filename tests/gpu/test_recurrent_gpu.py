"""The fused recurrent Triton kernels on the GPU: accuracy against the float64 oracle, the serving step
in a captured CUDA graph, and no host synchronisation.

Every op call runs inside ``torch.cuda.set_sync_debug_mode("error")`` with the launchers' outputs poisoned with
NaN (:func:`kda_ops.triton.launch.poison_outputs`): a host sync raises, an element a kernel forgets to write fails
the comparison. The comparisons themselves (which do read values on the host) run outside.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda_ops
from kda_ops import ops
from kda_ops.reference import naive_recurrent_kda
from kda_ops.testing import make_inputs, make_state, rel_err
from tests._gpu_checks import checked, compiled_variants
from tests.cases import (
    BF16,
    CU_GPU_RECURRENT,
    CU_GPU_SYNC,
    F64,
    RECURRENT_GPU_OPTIONS,
    RECURRENT_GRAD_TOL,
    RECURRENT_TOL,
    option_inputs,
    unit_qk,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"

# acceptance bounds (relative error against the float64 oracle)
TOL = RECURRENT_TOL
GRAD_TOL = RECURRENT_GRAD_TOL


def _inputs(name: str, B: int, T: int, H: int, K: int, V: int, HV: int, dtype: torch.dtype,
            seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Inputs on the GPU; keys unit-norm when the kernel does not normalise them (a stable recurrence at any K)."""
    x = option_inputs(name, B, T, H, K, V, HV=HV, dtype=dtype, seed=seed, device=DEV)
    if not x.get("use_qk_l2norm_in_kernel"):
        unit_qk(x, ("k",), via=F64)
    return x


def _run(fn: Any, x: dict[str, Any], h0: torch.Tensor | None, cu: torch.Tensor | None, grads: bool,
         seed: int = 3, check: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """``o``, the final state and (with ``grads``) the gradients of ``<o, do> + <final, dht>`` to every input."""
    leaves = {n: t.detach().clone().requires_grad_(grads) for n, t in x.items()
              if isinstance(t, torch.Tensor) and t.is_floating_point()}  # fmt: skip
    h = None if h0 is None else h0.detach().clone().requires_grad_(grads)
    args = {**x, **leaves}
    gen = torch.Generator(device=DEV).manual_seed(seed)
    with checked() if check else contextlib.nullcontext():
        o, s = fn(**args, initial_state=h, cu_seqlens=cu, output_final_state=True)
        assert s is not None
        out = {"o": o, "final_state": s}
        if grads:
            do = torch.randn(o.shape, generator=gen, device=DEV, dtype=F64)
            dht = torch.randn(s.shape, generator=gen, device=DEV, dtype=F64)
            ((o.double() * do).sum() + (s.double() * dht).sum()).backward()
            out.update({"d" + n: t.grad for n, t in leaves.items() if t.grad is not None})
            if h is not None and h.grad is not None:
                out["dinitial_state"] = h.grad
    return out


def _check(x: dict[str, Any], h0: torch.Tensor | None, cu: torch.Tensor | None = None, grads: bool = True) -> None:
    dtype = x["q"].dtype
    got = _run(kda_ops.recurrent_kda, x, h0, cu, grads, check=True)
    x64 = {n: t.double() if isinstance(t, torch.Tensor) else t for n, t in x.items()}
    ref = _run(naive_recurrent_kda, x64, None if h0 is None else h0.double(), cu, grads)
    assert got.keys() == ref.keys()
    errors = {n: rel_err(got[n], ref[n]) for n in got}
    limits = {n: (GRAD_TOL if n.startswith("d") else TOL)[dtype] for n in got}
    bad = {n: f"{e:.2e} > {limits[n]:.0e}" for n, e in errors.items() if not e <= limits[n]}
    everything = {n: f"{e:.1e}" for n, e in errors.items()}
    assert not bad, f"relative errors vs the float64 oracle: {bad} (all: {everything})"


# ----------------------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", RECURRENT_GPU_OPTIONS)
def test_every_option_forward_and_gradients(name: str, dtype: torch.dtype) -> None:
    x = _inputs(name, 2, 64, 2, 128, 128, HV=4, dtype=dtype)
    _check(x, make_state(2, 4, 128, 128, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_varlen_with_empty_sequences(dtype: torch.dtype) -> None:
    cu = torch.tensor(CU_GPU_RECURRENT, dtype=torch.int32, device=DEV)
    x = _inputs("all", 1, 160, 2, 128, 128, HV=4, dtype=dtype)
    h0 = make_state(6, 4, 128, 128, device=DEV)
    _check(x, h0, cu)
    with checked():
        _, s = kda_ops.recurrent_kda(**x, initial_state=h0, cu_seqlens=cu, output_final_state=True)
    assert s is not None and torch.equal(s[0], h0[0]) and torch.equal(s[2], h0[2])


@pytest.mark.parametrize(("K", "V"), [(100, 72), (256, 256), (64, 32)])
def test_head_dims(K: int, V: int) -> None:
    """Masked tiles (K, V not powers of two), the largest heads (256) and small ones."""
    x = _inputs("l2norm", 2, 24, 1, K, V, HV=2, dtype=torch.float32)
    _check(x, make_state(2, 2, K, V, device=DEV))


def test_gva_without_initial_state() -> None:
    x = _inputs("gate", 3, 40, 2, 128, 64, HV=8, dtype=BF16)
    _check(x, None)


def test_extreme_gates() -> None:
    """A hard reset (g = -1000) mid-sequence and no decay at all (g = 0) elsewhere."""
    x = _inputs("plain", 2, 48, 2, 128, 128, HV=2, dtype=torch.float32)
    x["g"][:, 10] = -1000.0
    x["g"][:, 30:] = 0.0
    _check(x, make_state(2, 2, 128, 128, device=DEV))


def test_backward_of_long_sequence() -> None:
    """T = 2048 (checkpoint interval 64: 32 segments recomputed and walked back)."""
    x = _inputs("all", 1, 2048, 1, 128, 128, HV=2, dtype=BF16)
    _check(x, make_state(1, 2, 128, 128, device=DEV))


# ------------------------------------------------------------------------------------------------ serving


def _decode_inputs(N: int, H: int, HV: int, K: int, V: int, T: int, seed: int) -> dict[str, torch.Tensor]:
    x = make_inputs(N, T, H, K, V, HV=HV, dtype=BF16, device=DEV, seed=seed, gate_in_kernel=True, beta_logits=True)
    return {n: x[n] for n in ("q", "k", "v", "g", "beta")}


SERVE_OPTS: dict[str, Any] = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True,
                              "use_beta_sigmoid_in_kernel": True}  # fmt: skip


def test_serving_step_matches_oracle() -> None:
    """The decode shape of the benchmark (B = 64, H = 32, K = V = 128): pool rows vs the float64 oracle."""
    N, H, K, V, S = 64, 32, 128, 128, 80
    x = _decode_inputs(N, H, H, K, V, 1, seed=0)
    params = make_inputs(1, 1, H, K, V, dtype=BF16, device=DEV, gate_in_kernel=True)
    opts = {**SERVE_OPTS, "A_log": params["A_log"], "dt_bias": params["dt_bias"]}
    pool = make_state(S, H, K, V, device=DEV)
    idx = torch.randperm(S, device=DEV)[:N]
    idx[5] = -1
    p = pool.clone()
    with checked():
        o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=idx, **opts)
    x64 = {n: t.double() if isinstance(t, torch.Tensor) else t for n, t in {**x, **opts}.items()}
    o_ref, s_ref = naive_recurrent_kda(**x64, initial_state=pool[idx.clamp(min=0)].double(), output_final_state=True)
    assert s_ref is not None
    keep = idx >= 0
    assert torch.equal(o[5], torch.zeros_like(o[5]))
    assert rel_err(o[keep], o_ref[keep]) <= TOL[BF16]
    assert rel_err(p[idx[keep]], s_ref[keep]) <= 1e-5  # the state itself is fp32 all the way
    untouched = torch.ones(S, dtype=torch.bool, device=DEV)
    untouched[idx[keep]] = False
    assert torch.equal(p[untouched], pool[untouched])


@pytest.mark.parametrize("varlen", [False, True], ids=["decode", "varlen-speculative"])
def test_serving_cuda_graph_decode_loop(varlen: bool) -> None:
    """Capture one step once, replay it 64 times with new inputs and new slots: equal to eager, bit for bit.

    ``decode``: one token per sequence. ``varlen-speculative``: 2 * N tokens split unevenly (0 to 4 tokens per
    sequence) by a ``cu_seqlens`` whose values change at every step.
    """
    N, H, HV, K, V, S, steps = 8, 2, 4, 128, 128, 24, 64
    T = 2 * N if varlen else 1
    B = 1 if varlen else N
    params = make_inputs(1, 1, H, K, V, HV=HV, dtype=BF16, device=DEV, gate_in_kernel=True)
    opts = {**SERVE_OPTS, "A_log": params["A_log"], "dt_bias": params["dt_bias"]}
    gen = torch.Generator(device=DEV).manual_seed(0)

    def step_inputs(t: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
        x = _decode_inputs(B, H, HV, K, V, T, seed=100 + t)
        idx = torch.randperm(S, device=DEV, generator=gen)[:N]
        idx[torch.randint(0, N, (1,), device=DEV, generator=gen)] = -1  # one padding sequence per step
        cu = None
        if varlen:
            lens = torch.full((N,), 2, device=DEV, dtype=torch.int64)
            shift = torch.randint(0, 5, (N // 2,), device=DEV, generator=gen) - 2  # move tokens between pairs
            lens[0::2] -= shift
            lens[1::2] += shift
            cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        return x, idx.to(torch.int32), cu

    pool0 = make_state(S, HV, K, V, device=DEV)
    x0, idx0, cu0 = step_inputs(-1)
    static = {n: t.clone() for n, t in x0.items()}
    static_idx = idx0.clone()
    static_cu = None if cu0 is None else cu0.clone()
    pool_graph, pool_eager = pool0.clone(), pool0.clone()

    # warm up (compile the kernel) on a side stream, on a throwaway pool
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        scratch = pool0.clone()
        for _ in range(2):
            kda_ops.recurrent_kda_update_(**static, state_pool=scratch, state_indices=static_idx,
                                          cu_seqlens=static_cu, **opts)  # fmt: skip
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = kda_ops.recurrent_kda_update_(**static, state_pool=pool_graph, state_indices=static_idx,
                                                 cu_seqlens=static_cu, **opts)  # fmt: skip
    assert torch.equal(pool_graph, pool0)  # capture records, it does not run

    for t in range(steps):
        x, idx, cu = step_inputs(t)
        for n in static:
            static[n].copy_(x[n])
        static_idx.copy_(idx)
        if static_cu is not None and cu is not None:
            static_cu.copy_(cu)
        with checked():
            graph.replay()
            o_eager = kda_ops.recurrent_kda_update_(**x, state_pool=pool_eager, state_indices=idx, cu_seqlens=cu,
                                                    **opts)  # fmt: skip
        assert torch.equal(o_static, o_eager), f"step {t}: graph output differs from eager"
        assert torch.equal(pool_graph, pool_eager), f"step {t}: graph pool differs from eager"
    assert not torch.equal(pool_graph, pool0)


def test_speculative_verify_matches_the_cpu_kernel_and_replays() -> None:
    """B = 64, H = 32, K = V = 128, 4 draft tokens per sequence, 2-D slots with num_accepted_tokens: outputs and the
    pool as the CPU reference kernel gives them; a CUDA-graph replay equal to eager, bit for bit; with
    write_states=False the pool untouched."""
    N, H, K, V, Ts = 64, 32, 128, 128, 4
    S = N * Ts + 8
    x = _decode_inputs(N, H, H, K, V, Ts, seed=3)
    params = make_inputs(1, 1, H, K, V, dtype=BF16, device=DEV, gate_in_kernel=True)
    opts = {**SERVE_OPTS, "A_log": params["A_log"], "dt_bias": params["dt_bias"]}
    pool = make_state(S, H, K, V, device=DEV)
    idx = torch.randperm(S, device=DEV)[: N * Ts].view(N, Ts).to(torch.int32)
    idx[3, 2] = -1
    idx[7, 0] = -1  # with one accepted: a padding sequence
    acc = torch.randint(1, Ts + 1, (N,), device=DEV, dtype=torch.int32)
    acc[7] = 1
    p = pool.clone()
    with checked():
        o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=idx, num_accepted_tokens=acc, **opts)
    p_cpu = pool.cpu()
    with ops.cpu_backend("reference"):
        o_cpu = kda_ops.recurrent_kda_update_(**{n: t.cpu() for n, t in x.items()}, state_pool=p_cpu,
                                              state_indices=idx.cpu(), num_accepted_tokens=acc.cpu(),
                                              **{n: t.cpu() if isinstance(t, torch.Tensor) else t
                                                 for n, t in opts.items()})  # fmt: skip
    assert rel_err(o.float().cpu(), o_cpu.float()) <= TOL[BF16] and torch.equal(o[7], torch.zeros_like(o[7]))
    assert rel_err(p.cpu(), p_cpu) <= 1e-5
    graph_pool, eager_pool = pool.clone(), pool.clone()
    kda_ops.recurrent_kda_update_(**x, state_pool=pool.clone(), state_indices=idx, num_accepted_tokens=acc,
                                  **opts)  # fmt: skip
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g = kda_ops.recurrent_kda_update_(**x, state_pool=graph_pool, state_indices=idx, num_accepted_tokens=acc,
                                            **opts)  # fmt: skip
    graph.replay()
    o_e = kda_ops.recurrent_kda_update_(**x, state_pool=eager_pool, state_indices=idx, num_accepted_tokens=acc,
                                        **opts)  # fmt: skip
    assert torch.equal(o_g, o_e) and torch.equal(graph_pool, eager_pool)
    q = pool.clone()
    with checked():
        o_r = kda_ops.recurrent_kda_update_(**x, state_pool=q, state_indices=idx, num_accepted_tokens=acc,
                                            write_states=False, **opts)  # fmt: skip
    assert torch.equal(q, pool) and torch.equal(o_r, o)


def test_bf16_pool_is_the_fp32_step_rounded_once() -> None:
    """A bfloat16 pool at the decode shape: outputs of the step from the pool's states as float32, and each state
    stored rounded once (as ``Tensor.bfloat16`` rounds the float32 pool's step), to one bf16 unit in the last place:
    the two pool dtypes compile to two kernels, whose fp32 arithmetic may be contracted and summed in another order,
    so a value next to a rounding boundary may round the other way; a second rounding (a drift) would be larger."""
    N, H, K, V, S = 64, 32, 128, 128, 80
    x = _decode_inputs(N, H, H, K, V, 1, seed=4)
    params = make_inputs(1, 1, H, K, V, dtype=BF16, device=DEV, gate_in_kernel=True)
    opts = {**SERVE_OPTS, "A_log": params["A_log"], "dt_bias": params["dt_bias"]}
    pool16 = make_state(S, H, K, V, device=DEV).bfloat16()
    pool32 = pool16.float()
    idx = torch.randperm(S, device=DEV)[:N]
    with checked():
        o16 = kda_ops.recurrent_kda_update_(**x, state_pool=pool16, state_indices=idx, **opts)
        o32 = kda_ops.recurrent_kda_update_(**x, state_pool=pool32, state_indices=idx, **opts)
    _assert_within_one_bf16_ulp(o16, o32, "o")
    _assert_within_one_bf16_ulp(pool16, pool32.bfloat16(), "state_pool")


def _assert_within_one_bf16_ulp(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    """``a`` and ``b`` (bf16) at most one bf16 unit in the last place apart everywhere, that unit taken at least at
    ``2^-6`` of ``b``'s RMS: a value summed from terms of the RMS's size with cancellation carries the fp32
    rounding of those terms (~1e-7 of them, two orders below this floor), which two summation orders need not
    share, and one ulp of such a small value is below it."""
    rms = b.float().square().mean().sqrt()
    ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(b.float().abs(), rms / 64)
    excess = ((a.float() - b.float()).abs() / ulp).max().item()
    assert excess <= 1.0, f"{name}: {excess:.2f} bf16 ulps apart at worst"


def test_serving_compiled_fullgraph_in_place() -> None:
    """torch.compile(fullgraph=True) of a decode step on the GPU: the pool is updated in place, equal to eager."""
    N, H, K, V, S = 16, 2, 128, 128, 32
    x = _decode_inputs(N, H, H, K, V, 1, seed=1)
    pool = make_state(S, H, K, V, device=DEV)
    idx = torch.randperm(S, device=DEV)[:N]

    def step(x: dict[str, torch.Tensor], pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=idx, use_qk_l2norm_in_kernel=True)

    p_eager = pool.clone()
    o_eager = step(x, p_eager, idx)
    p = pool.clone()
    ptr = p.data_ptr()
    o = torch.compile(step, fullgraph=True)(x, p, idx)
    assert p.data_ptr() == ptr and torch.equal(o, o_eager) and torch.equal(p, p_eager)


def test_sync_free_and_fully_written_everywhere() -> None:
    """Dense and varlen forward, backward and the serving step, all under sync-debug "error" with NaN outputs."""
    x = _inputs("all", 1, 50, 2, 128, 128, HV=4, dtype=BF16)
    cu = torch.tensor(CU_GPU_SYNC, device=DEV)
    h0 = make_state(3, 4, 128, 128, device=DEV)
    pool = make_state(5, 4, 128, 128, device=DEV)
    idx = torch.tensor([3, -1, 0], device=DEV)
    out = _run(kda_ops.recurrent_kda, x, h0, cu, grads=True, check=True)
    as_dense = {n: x[n].view(2, 25, *x[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")}
    dense = _run(kda_ops.recurrent_kda, {**x, **as_dense}, h0[:2], None, grads=True, check=True)
    with checked():
        o = kda_ops.recurrent_kda_update_(**{n: x[n] for n in ("q", "k", "v", "g", "beta")}, state_pool=pool,
                                          state_indices=idx, cu_seqlens=cu,
                                          **{n: x[n] for n in ("A_log", "dt_bias")}, **SERVE_OPTS)  # fmt: skip
    for name, t in [*out.items(), *dense.items(), ("serving o", o), ("pool", pool)]:
        assert torch.isfinite(t).all(), name


def test_triton_kernels_are_selected_on_cuda() -> None:
    assert {"recurrent", "recurrent_bwd", "recurrent_update_"} <= ops.TRITON_KERNELS
    assert all(ops.uses_triton(op, torch.device(DEV)) for op in ops.TRITON_KERNELS)


def test_cached_launch_equals_triton_launch() -> None:
    """The cached launch (``kda_ops.triton.launch``) runs what Triton's own launch runs: the first call goes through
    Triton and fills the cache, later calls take the cached kernel; outputs are bitwise equal. An input whose
    pointer is not 16-byte aligned is a new launch key (Triton specializes on alignment)."""
    from kda_ops.triton.recurrent import forward as tr

    x = make_inputs(3, 5, 4, 64, 64, dtype=BF16, device=DEV)
    h0 = make_state(3, 4, 64, 64, device=DEV)

    def call(q: torch.Tensor) -> tuple[torch.Tensor, Any]:
        with torch.inference_mode():
            return kda_ops.recurrent_kda(**{**x, "q": q}, initial_state=h0, output_final_state=True)

    tr._launch_fwd._cache.clear()
    first = call(x["q"])
    keys = len(tr._launch_fwd._cache)
    assert keys == 1
    for _ in range(3):
        again = call(x["q"])
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    buf = torch.empty(x["q"].numel() + 1, dtype=BF16, device=DEV)
    q_odd = buf[1:].view_as(x["q"]).copy_(x["q"])  # 2-byte aligned
    for _ in range(3):
        odd = call(q_odd)
        assert torch.equal(odd[0], first[0]) and torch.equal(odd[1], first[1])
    assert len(tr._launch_fwd._cache) == keys + 1


def test_warmup_compiles_every_step_length() -> None:
    """After ``kda_ops.warmup`` on 64 tokens, decode steps of 1 and 3 tokens, and the serving step with int32 and
    int64 slot indices, are captured with nothing left to compile (the kernel does not specialise on the length or
    the pool's size), each replay equal to its eager call."""
    from kda_ops.triton.recurrent import forward as recurrent

    x = make_inputs(2, 64, 4, 128, 128, HV=8, dtype=BF16, device=DEV)
    h0 = make_state(2, 8, 128, 128, device=DEV)
    opts: dict[str, Any] = dict(use_qk_l2norm_in_kernel=True)
    kda_ops.warmup(**x, initial_state=h0, output_final_state=True, **opts)
    kernel = recurrent.recurrent_fwd_kernel
    before = compiled_variants(kernel)

    def captured(fn: Any) -> tuple[Any, Any]:
        with torch.no_grad():
            ref = fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            graph.replay()
        return out, ref

    def decode(step: dict[str, torch.Tensor]) -> Any:
        return kda_ops.recurrent_kda(**step, initial_state=h0, output_final_state=True, **opts)

    def serve(step: dict[str, torch.Tensor], pool: torch.Tensor, start: torch.Tensor, slots: torch.Tensor) -> Any:
        pool.copy_(start)  # each call from the same pool, so the replay repeats the eager step
        return kda_ops.recurrent_kda_update_(**step, state_pool=pool, state_indices=slots, **opts)

    for T in (1, 3):
        out, ref = captured(functools.partial(decode, {n: t[:, :T] for n, t in x.items()}))
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), T
    for dtype in (torch.int32, torch.int64):
        start = make_state(5, 8, 128, 128, device=DEV)
        slots = torch.tensor([3, 1], device=DEV, dtype=dtype)
        step = {n: t[:, :1] for n, t in x.items()}
        out, ref = captured(functools.partial(serve, step, start.clone(), start, slots))
        assert torch.equal(out, ref), dtype
    assert compiled_variants(kernel) == before
