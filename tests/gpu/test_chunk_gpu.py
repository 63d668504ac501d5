"""The chunkwise Triton forward on the GPU: accuracy against the float64 oracle, variable length, CUDA
graphs and no host synchronisation.

The oracle is the reference chunkwise forward (``kda_ops.reference.chunk_fwd``) run in float64 on the GPU; it
equals the naive recurrence to ~1e-15 (``tests/reference/chunk/test_forward.py``) and is fast enough at T = 32k.
Every kernel call runs twice: once to compile and autotune, then inside ``torch.cuda.set_sync_debug_mode("error")``
with every launcher's outputs and scratch buffers poisoned with NaN (a host sync raises; an element a kernel forgets
to write fails the comparison); the second result is the one compared.

Inputs without the in-kernel l2norm get unit-norm q and k from the caller: long keys make the delta rule's solve
ill-conditioned for any fp32 code, which would test the inputs rather than the kernels.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kda_ops
from kda_ops import reference
from kda_ops.testing import make_inputs, make_state, rel_err
from tests._gpu_checks import checked, compiled_variants
from tests.cases import (
    BF16,
    CHUNK_OPTIONS,
    CHUNK_TOL,
    CU_GPU_CHUNK,
    CU_GPU_PARTIAL,
    CU_GPU_RESETS,
    hard_reset,
    option_inputs,
    options,
    set_gates,
    unit_qk,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"

# acceptance bounds (relative error against the float64 oracle)
TOL = CHUNK_TOL


def _case(name: str, B: int, T: int, H: int, K: int, V: int, HV: int, dtype: torch.dtype, gates: str = "normal",
          seed: int = 0) -> dict[str, Any]:  # fmt: skip
    x = option_inputs(name, B, T, H, K, V, HV=HV, dtype=dtype, seed=seed, device=DEV)
    if not x.get("use_qk_l2norm_in_kernel", False):
        unit_qk(x)
    if gates == "reset":  # hard resets on every channel, and on half of the channels
        hard_reset(x["g"], (0, 3, 64, 100, 777), T // 2)
    elif gates != "normal":  # "zero"; "strong": every 16-token block spans 72 nats, the exact pairwise blocks
        set_gates(x["g"], gates)
    return x


def _oracle(x: dict[str, Any], h0: torch.Tensor | None, cu: torch.Tensor | None, scale: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The float64 chunkwise reference on the GPU."""
    d = {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in x.items()}
    K = x["q"].shape[-1]
    return reference.chunk_fwd(
        d["q"], d["k"], d["v"], d["g"], d["beta"], K**-0.5 if scale is None else scale,
        None if h0 is None else h0.double(), cu, d.get("A_log"), d.get("dt_bias"), options(x), True,
    )  # fmt: skip


def _chunk(x: dict[str, Any], h0: torch.Tensor | None = None, cu: torch.Tensor | None = None, final: bool = True,
           fn: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``chunk_kda`` (or ``fn``) once to compile and tune, then again sync-checked and poisoned."""
    fn = fn or kda_ops.chunk_kda
    fn(**x, initial_state=h0, cu_seqlens=cu, output_final_state=final)
    with checked():
        out: tuple[torch.Tensor, torch.Tensor | None] = fn(**x, initial_state=h0, cu_seqlens=cu,
                                                           output_final_state=final)  # fmt: skip
    return out


def _check(x: dict[str, Any], h0: torch.Tensor | None = None, cu: torch.Tensor | None = None,
           tol: float | None = None) -> tuple[float, float]:  # fmt: skip
    o, s = _chunk(x, h0, cu)
    o_ref, s_ref = _oracle(x, h0, cu)
    tol = TOL[x["v"].dtype] if tol is None else tol
    assert s is not None and s.dtype == torch.float32 and o.dtype == x["v"].dtype
    eo, es = rel_err(o, o_ref), rel_err(s, s_ref)
    assert eo <= tol and es <= tol, f"relative error o {eo:.2e}, final state {es:.2e} > {tol:.0e}"
    return eo, es


# ------------------------------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000, 4096])
def test_lengths(T: int, dtype: torch.dtype) -> None:
    x = _case("l2norm", 2, T, 2, 128, 128, HV=4, dtype=dtype)
    _check(x, h0=make_state(2, 4, 128, 128, device=DEV))


# every (K, V, dtype, options) compiles and autotunes its kernels once (~10 s each): a subset of the products
HEAD_DIMS = [(64, 64, BF16), (100, 100, BF16), (256, 256, BF16), (64, 256, BF16), (256, 64, BF16), (100, 128, BF16),
             (128, 100, BF16), (64, 64, torch.float32), (100, 100, torch.float32), (256, 256, torch.float32)]
ALL = [(name, BF16) for name in CHUNK_OPTIONS] + [(name, torch.float32) for name in ("plain", "lower_bound", "all")]


@pytest.mark.parametrize(("K", "V", "dtype"), HEAD_DIMS)
def test_head_dims(K: int, V: int, dtype: torch.dtype) -> None:
    x = _case("l2norm", 1, 1000, 2, K, V, HV=4, dtype=dtype)
    _check(x, h0=make_state(1, 4, K, V, device=DEV))


@pytest.mark.parametrize(("name", "dtype"), ALL)
def test_every_option(name: str, dtype: torch.dtype) -> None:
    x = _case(name, 2, 300, 2, 64, 64, HV=4, dtype=dtype)
    _check(x, h0=make_state(2, 4, 64, 64, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gates", ["reset", "zero", "strong"])
def test_extreme_gates(gates: str, dtype: torch.dtype) -> None:
    """Hard resets (g = -1000), no decay at all, and 16-token blocks beyond the factored span."""
    x = _case("l2norm", 1, 1000, 1, 128, 128, HV=2, dtype=dtype, gates=gates)
    _check(x, h0=make_state(1, 2, 128, 128, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_varlen_empty_and_one_token_sequences(dtype: torch.dtype) -> None:
    cu_list = CU_GPU_CHUNK
    cu = torch.tensor(cu_list, device=DEV, dtype=torch.int32)
    N = len(cu_list) - 1
    x = _case("all", 1, cu_list[-1], 2, 128, 128, HV=4, dtype=dtype)
    h0 = make_state(N, 4, 128, 128, device=DEV)
    _check(x, h0=h0, cu=cu)
    _, s = _chunk(x, h0, cu)
    assert s is not None
    for n in (0, 2):  # the empty sequences keep their initial state, bit for bit
        assert torch.equal(s[n], h0[n])


def test_fp16() -> None:
    x = _case("all", 2, 1000, 2, 128, 128, HV=4, dtype=torch.float16)
    _check(x, h0=make_state(2, 4, 128, 128, device=DEV))


def test_no_state_in_or_out() -> None:
    x = _case("l2norm", 2, 500, 2, 128, 128, HV=2, dtype=BF16)
    o, s = _chunk(x, final=False)
    assert s is None
    o_ref, _ = _oracle(x, None, None)
    assert rel_err(o, o_ref) <= TOL[BF16]


def test_long_sequence_bf16() -> None:
    """T = 32k in bf16 against the float64 reference: the per-chunk rounding does not accumulate."""
    x = _case("l2norm", 1, 32768, 4, 128, 128, HV=4, dtype=BF16)
    eo, es = _check(x, h0=make_state(1, 4, 128, 128, device=DEV))
    print(f"T=32768 bf16: relative error o {eo:.3e}, final state {es:.3e}")


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_chunk_equals_recurrent(dtype: torch.dtype) -> None:
    """The two Triton schedules on the same inputs compute the same function."""
    x = _case("all", 2, 1000, 2, 128, 128, HV=4, dtype=dtype)
    h0 = make_state(2, 4, 128, 128, device=DEV)
    o_c, s_c = _chunk(x, h0)
    o_r, s_r = _chunk(x, h0, fn=kda_ops.recurrent_kda)
    assert s_c is not None and s_r is not None
    assert rel_err(o_c, o_r) <= TOL[dtype] and rel_err(s_c, s_r) <= TOL[dtype]


def test_staged_pipeline_equals_fused() -> None:
    from kda_ops.triton.chunk.forward import chunk_fwd
    from tests.triton.chunk.stage_kernels import chunk_fwd_staged

    cu = torch.tensor(CU_GPU_RESETS, device=DEV)
    x = _case("all", 1, 2000, 2, 128, 128, HV=4, dtype=BF16, gates="reset")
    h0 = make_state(5, 4, 128, 128, device=DEV)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, h0, cu, x["A_log"], x["dt_bias"], options(x), True)
    o_ref, s_ref = _oracle(x, h0, cu)
    for fn in (chunk_fwd, chunk_fwd_staged):
        o, s = fn(*args)
        assert rel_err(o, o_ref) <= TOL[BF16] and rel_err(s, s_ref) <= TOL[BF16], fn.__name__


@pytest.mark.parametrize("per_item", [False, True], ids=["per_sm", "per_item"])
def test_output_stage_forms(per_item: bool) -> None:
    """Both forms of the 16-bit output stage (programs walking 128-wide items, a program per 64-wide item; the
    forward picks by the number of items) on varlen input with empty sequences, against the oracle."""
    from kda_ops.triton import force_forms

    cu = torch.tensor(CU_GPU_RESETS, device=DEV)
    x = _case("l2norm", 1, 2000, 2, 128, 128, HV=4, dtype=BF16, gates="reset")
    with force_forms(output_per_item=per_item):
        _check(x, h0=make_state(5, 4, 128, 128, device=DEV), cu=cu)


# ---------------------------------------------------------------------------- graphs, compile, sync


def test_cuda_graph_replay_with_new_cu_seqlens() -> None:
    """One capture after kda_ops.warmup serves every cu_seqlens of the same length, equal to eager calls."""
    T, H, HV, K, V = 2048, 2, 4, 128, 128
    x = _case("all", 1, T, H, K, V, HV=HV, dtype=BF16)
    cu = torch.tensor([0, 100, 100, 1500, T], device=DEV, dtype=torch.int32)
    h0 = make_state(4, HV, K, V, device=DEV)
    kw = dict(x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    small = {n: t[:, :64] if n in ("q", "k", "v", "g", "beta") else t for n, t in x.items()}
    kda_ops.warmup(**small, initial_state=h0, output_final_state=True,
                   cu_seqlens=torch.tensor([0, 10, 10, 30, 64], device=DEV, dtype=torch.int32))  # fmt: skip
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the allocator's warm-up for capture, on a side stream
        kda_ops.chunk_kda(**kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, s_g = kda_ops.chunk_kda(**kw)
    assert s_g is not None
    for values in ([0, 100, 100, 1500, T], [0, 1, 2, 3, T], [0, T, T, T, T], [0, 0, 0, 0, T], [0, 333, 334, 1999, T]):
        cu.copy_(torch.tensor(values, dtype=torch.int32))
        graph.replay()
        o_e, s_e = kda_ops.chunk_kda(**dict(kw, cu_seqlens=cu.clone()))
        assert s_e is not None
        assert torch.equal(o_g, o_e), values
        assert torch.equal(s_g, s_e), values


def test_warmup_leaves_nothing_to_compile() -> None:
    """After a warm-up on 64 tokens, calls at other lengths (T not a multiple of 16, an odd number of chunk slots;
    the output stage's other form at T = 4096) are captured with nothing left to compile: no Triton kernel cache of
    the forward grows."""
    from kda_ops.triton.chunk import decays, output, prepare, scan, slots

    kernels = (slots.dense_map_kernel, decays.anchor_sums_kernel, prepare.chunk_prepare_kernel,
               prepare.chunk_prepare_blocks_kernel, scan.chunk_state_kernel, output.chunk_output_kernel)

    x = _case("l2norm", 1, 4096, 32, 128, 128, HV=32, dtype=BF16)

    def head(n: int) -> dict[str, Any]:
        return {name: t[:, :n] if name in ("q", "k", "v", "g", "beta") else t for name, t in x.items()}

    kda_ops.warmup(**head(64), output_final_state=True)
    before = compiled_variants(*kernels)
    for T in (1000, 4096, 127):
        xt = head(T)
        with torch.no_grad():
            ref = kda_ops.chunk_kda(**xt, output_final_state=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = kda_ops.chunk_kda(**xt, output_final_state=True)
            graph.replay()
        assert out[1] is not None and ref[1] is not None
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), T
        assert compiled_variants(*kernels) == before, T


def test_compiled_graph_serves_any_cu_seqlens() -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(kda_ops.chunk_kda, fullgraph=True, backend=counter)
    x = _case("l2norm", 1, 1000, 2, 64, 64, HV=2, dtype=BF16)
    for values in ([0, 10, 10, 1000], [0, 999, 1000, 1000], [0, 0, 500, 1000]):
        cu = torch.tensor(values, device=DEV, dtype=torch.int32)
        o, _ = fn(**x, cu_seqlens=cu)
        o_e, _ = kda_ops.chunk_kda(**x, cu_seqlens=cu)
        assert torch.equal(o, o_e)
    assert counter.frame_count == 1


def test_nan_poison_reaches_no_output() -> None:
    """Poisoned outputs and scratch buffers are fully overwritten (also checked in every call above): here with a
    partial last chunk, an empty sequence at the end, and no initial state."""
    cu = torch.tensor(CU_GPU_PARTIAL, device=DEV)
    x = _case("l2norm", 1, 131, 1, 100, 100, HV=1, dtype=BF16)
    o, s = _chunk(x, cu=cu)
    assert s is not None and torch.isfinite(o).all() and torch.isfinite(s).all()
    assert torch.equal(s[1], torch.zeros_like(s[1])) and torch.equal(s[3], torch.zeros_like(s[3]))


def test_dense_batch_on_a_side_stream_and_captured() -> None:
    """A dense batch on a side stream and captured in a CUDA graph (its chunk map built inside the graph) gives what
    the eager call on the default stream gave, bitwise."""
    x = make_inputs(2, 130, 4, 64, 64, dtype=BF16, device=DEV)
    with torch.no_grad():
        ref = kda_ops.chunk_kda(**x, output_final_state=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = kda_ops.chunk_kda(**x, output_final_state=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = kda_ops.chunk_kda(**x, output_final_state=True)
        graph.replay()
        torch.cuda.synchronize()
    for out in (on_side, captured):
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.parametrize("segments", [None, 4], ids=["rule", "split-4"])
def test_chunk_prefill_into_the_pool(segments: int | None) -> None:
    """``chunk_kda_update_`` (B = 4, T = 1000, bf16, fp32 pool, random slots, one padding sequence) equals gather
    -> ``chunk_kda`` -> scatter bit for bit, with the plain and the split scan; a CUDA-graph replay equals eager."""
    from kda_ops.triton.launch import force_forms

    B, T, H, D, S = 4, 1000, 4, 128, 11
    x = make_inputs(B, T, H, D, D, dtype=torch.bfloat16, device=DEV, seed=8)
    pool = make_state(S, H, D, D, device=DEV)
    idx = torch.tensor([7, -1, 2, 9], device=DEV)
    with force_forms(scan_segments=segments), torch.no_grad():
        o_ref, s_ref = kda_ops.chunk_kda(**x, initial_state=pool[idx.clamp(min=0)], output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert s_ref is not None
        p = pool.clone()
        with checked():
            o = kda_ops.chunk_kda_update_(**x, state_pool=p, state_indices=idx, use_qk_l2norm_in_kernel=True)
        keep = idx >= 0
        assert torch.equal(o[keep], o_ref[keep]) and torch.equal(o[1], torch.zeros_like(o[1]))
        expect = pool.clone()
        expect[idx[keep]] = s_ref[keep]
        assert torch.equal(p, expect)
        g_pool, e_pool = pool.clone(), pool.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g = kda_ops.chunk_kda_update_(**x, state_pool=g_pool, state_indices=idx, use_qk_l2norm_in_kernel=True)
        graph.replay()
        o_e = kda_ops.chunk_kda_update_(**x, state_pool=e_pool, state_indices=idx, use_qk_l2norm_in_kernel=True)
        assert torch.equal(o_g, o_e) and torch.equal(g_pool, e_pool)
