"""The serving step ``recurrent_kda_update_`` / ``torch.ops.kda.recurrent_update_`` on the CPU.

Each behaviour is checked on the PyTorch reference kernel and, under ``TRITON_INTERPRET=1``, on the Triton kernel.
The expected values come from :func:`kda_ops.recurrent_kda` started from the pool's states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kda_ops
from kda_ops import ops
from kda_ops.testing import make_inputs, make_state

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.interpret)]
H, HV, K, V, S = 1, 2, 8, 8, 6


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    name: str = request.param
    with contextlib.ExitStack() as stack:
        stack.enter_context(ops.cpu_backend(name))
        if name == "triton":
            from kda_ops.triton.launch import poison_outputs

            stack.enter_context(poison_outputs())
        yield name


def _expected(x: dict[str, Any], pool: torch.Tensor, idx: list[int], cu: torch.Tensor | None,
              **opts: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``o`` and the updated pool, from recurrent_kda started at the pool's slots (padding: zero rows)."""
    slots = torch.tensor([max(i, 0) for i in idx])
    o, final = kda_ops.recurrent_kda(**x, initial_state=pool[slots], cu_seqlens=cu, output_final_state=True, **opts)
    assert final is not None
    new = pool.clone()
    for n, i in enumerate(idx):
        if i >= 0:
            new[i] = final[n]
        elif cu is None:
            o[n] = 0
        else:
            o[:, int(cu[n]) : int(cu[n + 1])] = 0
    return o, new


def test_decode_step_updates_pool_in_place(backend: str) -> None:
    x = make_inputs(4, 1, H, K, V, HV=HV)
    pool = make_state(S, HV, K, V)
    idx = [5, 0, 3, 2]
    o_ref, pool_ref = _expected(x, pool, idx, None)
    p = pool.clone()
    ptr = p.data_ptr()
    o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=torch.tensor(idx))
    assert o.shape == (4, 1, HV, V) and o.dtype == x["v"].dtype and p.data_ptr() == ptr
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p, pool_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(p[[1, 4]], pool[[1, 4]])  # untouched slots are bitwise unchanged


def test_padding_slot_is_skipped(backend: str) -> None:
    x = make_inputs(3, 1, H, K, V, HV=HV)
    x["v"][1] = float("nan")  # whatever a padding row holds must not leak
    pool = make_state(S, HV, K, V)
    idx = [2, -1, 0]
    p = pool.clone()
    o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=torch.tensor(idx, dtype=torch.int32))
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert torch.isfinite(p).all()
    assert torch.equal(p[[1, 3, 4, 5]], pool[[1, 3, 4, 5]])
    x["v"][1] = 0.0
    o_ref, pool_ref = _expected(x, pool, idx, None)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p, pool_ref, rtol=1e-5, atol=1e-6)


def test_several_tokens_per_sequence_varlen(backend: str) -> None:
    """Chunked prefill / speculative steps: 3, 0, 1, 4 tokens; the empty sequence keeps its state."""
    cu = torch.tensor([0, 3, 3, 4, 8])
    x = make_inputs(1, 8, H, K, V, HV=HV, gate_in_kernel=True, beta_logits=True)
    opts = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    pool = make_state(S, HV, K, V)
    idx = [4, 1, -1, 0]
    o_ref, pool_ref = _expected(x, pool, idx, cu, **opts)
    p = pool.clone()
    o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=torch.tensor(idx), cu_seqlens=cu, **opts)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p, pool_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(o[:, 3], torch.zeros_like(o[:, 3]))


def test_dense_batch_of_several_tokens(backend: str) -> None:
    x = make_inputs(2, 3, H, K, V, HV=HV, gate_in_kernel=True)
    opts = {"use_gate_in_kernel": True, "lower_bound": -5.0}
    pool = make_state(S, HV, K, V)
    idx = [1, 3]
    o_ref, pool_ref = _expected(x, pool, idx, None, **opts)
    p = pool.clone()
    o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=torch.tensor(idx), **opts)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p, pool_ref, rtol=1e-5, atol=1e-6)


def test_decode_loop_equals_one_call(backend: str) -> None:
    """Six decode steps through the pool (slots moving between steps) equal one call over the six tokens."""
    T = 6
    x = make_inputs(2, T, H, K, V, HV=HV)
    pool = make_state(S, HV, K, V)
    o_ref, s_ref = kda_ops.recurrent_kda(**x, initial_state=pool[[0, 1]], output_final_state=True)
    assert s_ref is not None
    p = pool.clone()
    slots = [0, 1]
    for t in range(T):
        step = {n: v[:, t : t + 1] for n, v in x.items()}
        o = kda_ops.recurrent_kda_update_(**step, state_pool=p, state_indices=torch.tensor(slots))
        torch.testing.assert_close(o, o_ref[:, t : t + 1], rtol=1e-5, atol=1e-6)
        # move both states to fresh slots: the indices change between steps, the shapes do not
        new = [(s + 2) % S for s in slots]
        p[new] = p[slots]
        slots = new
    torch.testing.assert_close(p[slots], s_ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------- speculative verify


def _prefix_states(x: dict[str, Any], h0: torch.Tensor, n_tok: int) -> list[torch.Tensor]:
    """The states of every sequence of the dense batch ``x`` after each of its first ``n_tok`` tokens, from ``h0``
    (each from ``recurrent_kda`` on that prefix alone)."""
    out = []
    for t in range(1, n_tok + 1):
        _, s = kda_ops.recurrent_kda(**{n: v[:, :t] for n, v in x.items()}, initial_state=h0,
                                     output_final_state=True)  # fmt: skip
        assert s is not None
        out.append(s)
    return out


def test_speculative_step_writes_each_token_state_and_resumes_from_the_accepted(backend: str) -> None:
    """2-D slots: the state after each draft token lands in its own slot, -1 columns are skipped, padding rows are
    zeros; the next step from ``num_accepted_tokens`` equals running only the accepted tokens then the new ones."""
    B, Ts, S2 = 3, 3, 12
    x = make_inputs(B, Ts, H, K, V, HV=HV, seed=1)
    pool = make_state(S2, HV, K, V)
    idx = torch.tensor([[0, 1, 2], [3, -1, 5], [-1, 7, 8]])  # the last sequence is padding (first slot -1)
    p = pool.clone()
    o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=idx)
    h0 = pool[idx[:, 0].clamp(min=0)]
    o_ref, _ = kda_ops.recurrent_kda(**x, initial_state=h0)
    torch.testing.assert_close(o[:2], o_ref[:2], rtol=1e-5, atol=1e-6)
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    states = _prefix_states(x, h0, Ts)
    expect = pool.clone()
    for n in range(2):
        for t in range(Ts):
            if idx[n, t] >= 0:
                expect[idx[n, t]] = states[t][n]
    torch.testing.assert_close(p, expect, rtol=1e-5, atol=1e-6)
    # the next verify step resumes each sequence after its accepted drafts
    accepted = torch.tensor([2, 3, 1])
    nxt = make_inputs(B, 2, H, K, V, HV=HV, seed=2)
    q = p.clone()
    idx_next = torch.tensor([[0, 1, 2, 9], [3, -1, 5, 11], [6, 7, 8, 10]])  # T_spec 4 > 2 tokens
    o2 = kda_ops.recurrent_kda_update_(**nxt, state_pool=q, state_indices=idx_next, num_accepted_tokens=accepted)
    starts = torch.stack([p[idx_next[n, int(accepted[n]) - 1]] for n in range(2)] + [p[6]])
    o2_ref, s2_ref = kda_ops.recurrent_kda(**nxt, initial_state=starts, output_final_state=True)
    torch.testing.assert_close(o2[:2], o2_ref[:2], rtol=1e-5, atol=1e-6)
    assert s2_ref is not None
    # sequence 0 (accepted 2: started from slot 1) wrote its two new states to slots 0 and 1
    _, s_first = kda_ops.recurrent_kda(**{n: v[:1, :1] for n, v in nxt.items()}, initial_state=starts[:1],
                                       output_final_state=True)  # fmt: skip
    assert s_first is not None
    torch.testing.assert_close(q[0], s_first[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q[1], s2_ref[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(q[9], p[9]) and torch.equal(q[10], p[10])  # columns past its 2 tokens: untouched


def test_speculative_step_varlen_equals_the_dense_one(backend: str) -> None:
    """Packed rows of 3 and 1 tokens with 2-D slots: outputs and written states as the dense per-sequence calls."""
    x = make_inputs(1, 4, H, K, V, HV=HV, seed=3)
    cu = torch.tensor([0, 3, 4])
    pool = make_state(10, HV, K, V)
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]])
    acc = torch.tensor([2, 1])
    p = pool.clone()
    o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=idx, cu_seqlens=cu, num_accepted_tokens=acc)
    for n, (b, e) in enumerate([(0, 3), (3, 4)]):
        xs = {k_: t[:, b:e] for k_, t in x.items()}
        h0 = pool[idx[n, int(acc[n]) - 1]][None]
        o_ref, _ = kda_ops.recurrent_kda(**xs, initial_state=h0)
        torch.testing.assert_close(o[:, b:e], o_ref, rtol=1e-5, atol=1e-6)
        for t, st in enumerate(_prefix_states(xs, h0, e - b)):
            torch.testing.assert_close(p[idx[n, t]], st[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(p[4], pool[4]) and torch.equal(p[5], pool[5])  # sequence 1 has one token
    assert torch.equal(p[6:], pool[6:])


def test_verify_without_writing_states_leaves_the_pool_bit_for_bit(backend: str) -> None:
    x = make_inputs(2, 3, H, K, V, HV=HV, seed=4)
    pool = make_state(S, HV, K, V)
    for idx in (torch.tensor([4, 1]), torch.tensor([[4, 0, 2], [1, 3, 5]])):
        p = pool.clone()
        o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=idx, write_states=False)
        o_ref, _ = kda_ops.recurrent_kda(**x, initial_state=pool[idx if idx.dim() == 1 else idx[:, 0]])
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(p, pool)


def test_bf16_pool_rounds_each_stored_state_once(backend: str) -> None:
    """A bfloat16 pool: each step starts from its slots in float32 and stores its final state rounded once; over a
    speculative step each per-token state is rounded on its own store, the carried state stays float32."""
    x = make_inputs(3, 2, H, K, V, HV=HV, seed=5)
    pool = make_state(S, HV, K, V).bfloat16()
    idx = torch.tensor([4, 0, 2])
    p = pool.clone()
    o = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=idx)
    o_ref, s_ref = kda_ops.recurrent_kda(**x, initial_state=pool[idx].float(), output_final_state=True)
    assert s_ref is not None
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    # one rounding, to nearest; under the interpreter (whose fp32 -> bf16 conversion truncates) within one ulp
    ulp = 0.0 if backend == "reference" else 2.0**-7
    torch.testing.assert_close(p[idx].float(), s_ref.bfloat16().float(), rtol=ulp, atol=0)
    p = pool.clone()
    idx2 = torch.tensor([[4, 1], [0, 3], [2, 5]])
    o2 = kda_ops.recurrent_kda_update_(**x, state_pool=p, state_indices=idx2)
    torch.testing.assert_close(o2, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p[idx2[:, 1]].float(), s_ref.bfloat16().float(), rtol=ulp, atol=0)


# ------------------------------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunk_prefill_into_the_pool_equals_gather_chunk_scatter(backend: str, varlen: bool,
                                                                 pool_dtype: torch.dtype) -> None:  # fmt: skip
    """``chunk_kda_update_`` against gather -> ``chunk_kda`` -> scatter: the same outputs, the same states in the
    slots (rounded once to a bf16 pool), a padding sequence's rows zero and every other slot untouched bit for
    bit; sequences long enough to span several chunks."""
    if varlen:
        x = make_inputs(1, 200, H, K, V, HV=HV, seed=6)
        cu: torch.Tensor | None = torch.tensor([0, 70, 71, 200])
    else:
        x = make_inputs(3, 90, H, K, V, HV=HV, seed=6)
        cu = None
    pool = make_state(S, HV, K, V).to(pool_dtype)
    idx = [4, -1, 1]
    slots = torch.tensor([max(i, 0) for i in idx])
    o_ref, s_ref = kda_ops.chunk_kda(**x, initial_state=pool[slots].float(), cu_seqlens=cu, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert s_ref is not None
    p = pool.clone()
    o = kda_ops.chunk_kda_update_(**x, state_pool=p, state_indices=torch.tensor(idx), cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True)  # fmt: skip
    rows = [slice(0, 70), slice(70, 71), slice(71, 200)] if varlen else None
    for n in (0, 2):
        got, want = (o[:, rows[n]], o_ref[:, rows[n]]) if rows else (o[n], o_ref[n])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        ulp = 0.0 if backend == "reference" or pool_dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(p[idx[n]].float(), s_ref[n].to(pool_dtype).float(), rtol=max(ulp, 1e-5),
                                   atol=1e-6)  # fmt: skip
    pad = o[:, rows[1]] if rows else o[1]
    assert torch.equal(pad, torch.zeros_like(pad))
    untouched = [i for i in range(S) if i not in (4, 1)]
    assert torch.equal(p[untouched], pool[untouched])


@pytest.mark.interpret
def test_chunk_prefill_with_the_split_scan() -> None:
    """The split scan (3 segments of a 4-chunk sequence) reads the first segment's state from the pool slot and
    writes the last one's back, as the plain scan does."""
    from kda_ops.triton.launch import force_forms, poison_outputs

    x = make_inputs(2, 256, H, K, V, HV=HV, seed=7)
    pool = make_state(S, HV, K, V)
    idx = torch.tensor([3, 0])
    ckpt = {"checkpoint_every": 128, "checkpoint_indices": torch.tensor([[1, -1], [4, 5]])}  # after 128 and 256
    with ops.cpu_backend("triton"), poison_outputs():
        p1, p3 = pool.clone(), pool.clone()
        o1 = kda_ops.chunk_kda_update_(**x, state_pool=p1, state_indices=idx, **ckpt)
        with force_forms(scan_segments=3):
            o3 = kda_ops.chunk_kda_update_(**x, state_pool=p3, state_indices=idx, **ckpt)
    torch.testing.assert_close(o3, o1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p3, p1, rtol=1e-5, atol=1e-6)
    assert not torch.equal(p1[3], pool[3]) and torch.equal(p1[2], pool[2])
    torch.testing.assert_close(p1[5], p1[0], rtol=0, atol=0)  # the checkpoint after all 256 tokens: the final state
    assert not torch.equal(p1[1], pool[1]) and not torch.equal(p1[4], pool[4])


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_chunk_prefill_writes_prefix_checkpoints(backend: str, varlen: bool) -> None:
    """Checkpoints every 64 tokens: each slot holds the state after that many tokens of its sequence (``chunk_kda``
    on the prefix alone); -1 columns, checkpoints past a sequence's end and padding sequences write nothing."""
    S2 = 16
    if varlen:
        x = make_inputs(1, 300, H, K, V, HV=HV, seed=9)
        cu: torch.Tensor | None = torch.tensor([0, 192, 300])
        bounds = [(0, 0, 192), (0, 192, 300)]
    else:
        x = make_inputs(2, 150, H, K, V, HV=HV, seed=9)
        cu = None
        bounds = [(0, 0, 150), (1, 0, 150)]
    pool = make_state(S2, HV, K, V)
    idx = torch.tensor([0, 1])
    ckpt = torch.tensor([[2, 3, 4, 5], [6, -1, 8, 9]])
    p = pool.clone()
    kda_ops.chunk_kda_update_(**x, state_pool=p, state_indices=idx, cu_seqlens=cu, checkpoint_every=64,
                              checkpoint_indices=ckpt)  # fmt: skip
    written = {0, 1}
    for n, (b, bos, eos) in enumerate(bounds):
        for m in range(4):
            end = bos + 64 * (m + 1)
            slot = int(ckpt[n, m])
            if slot < 0 or end > eos:
                continue
            _, s_ref = kda_ops.chunk_kda(**{k_: t[b : b + 1, bos:end] for k_, t in x.items()},
                                         initial_state=pool[idx[n : n + 1]], output_final_state=True)  # fmt: skip
            assert s_ref is not None
            torch.testing.assert_close(p[slot], s_ref[0], rtol=1e-5, atol=1e-6)
            written.add(slot)
    rest = [i for i in range(S2) if i not in written]
    assert torch.equal(p[rest], pool[rest])
    assert written >= ({0, 1, 2, 3, 4, 6} if varlen else {0, 1, 2, 3, 6})


def test_chunk_prefill_padding_sequence_writes_no_checkpoint(backend: str) -> None:
    """A padding sequence (slot -1) leaves its checkpoint slots alone too; an empty checkpoint table and an empty
    pool are accepted."""
    x = make_inputs(2, 128, H, K, V, HV=HV, seed=10)
    pool = make_state(S, HV, K, V)
    p = pool.clone()
    kda_ops.chunk_kda_update_(**x, state_pool=p, state_indices=torch.tensor([0, -1]), checkpoint_every=64,
                              checkpoint_indices=torch.tensor([[2, 3], [4, 5]]))  # fmt: skip
    assert torch.equal(p[[1, 4, 5]], pool[[1, 4, 5]])
    assert not torch.equal(p[2], pool[2]) and not torch.equal(p[3], pool[3])
    q = pool.clone()
    kda_ops.chunk_kda_update_(**x, state_pool=q, state_indices=torch.tensor([0, 1]), checkpoint_every=64,
                              checkpoint_indices=torch.zeros(2, 0, dtype=torch.int64))  # fmt: skip
    o = kda_ops.chunk_kda_update_(**x, state_pool=pool[:0].clone(), state_indices=torch.tensor([-1, -1]))
    assert torch.equal(o, torch.zeros_like(o))


def test_chunk_update_op_refuses_a_checkpoint_spacing_off_the_chunks() -> None:
    x = make_inputs(1, 128, H, K, V, HV=HV)
    for every in (0, 96):
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], make_state(S, HV, K, V), torch.tensor([0]), K**-0.5,
                None, None, None, None, False, False, False, False, False, every, torch.tensor([[1]]))  # fmt: skip
        with pytest.raises(ValueError, match="checkpoint_every"):
            torch.ops.kda.chunk_update_(*args)


def test_chunk_prefill_validation_names_the_argument() -> None:
    x = make_inputs(2, 4, H, K, V, HV=HV)
    pool = make_state(S, HV, K, V)
    two = torch.tensor([0, 1])
    for every, ckpt, exc, name in [
        (64, None, ValueError, "checkpoint_every"),
        (None, torch.tensor([[2], [3]]), ValueError, "checkpoint_every"),
        (100, torch.tensor([[2], [3]]), ValueError, "checkpoint_every"),
        (64, torch.tensor([2, 3]), ValueError, "checkpoint_indices"),
        (64, torch.tensor([[2.0], [3.0]]), TypeError, "checkpoint_indices"),
        (64, torch.tensor([[1], [3]]), ValueError, "checkpoint_indices"),
        (64, torch.tensor([[S], [3]]), ValueError, "checkpoint_indices"),
    ]:
        with pytest.raises(exc, match=name):
            kda_ops.chunk_kda_update_(**x, state_pool=pool, state_indices=two, checkpoint_every=every,
                                      checkpoint_indices=ckpt)  # fmt: skip
    with pytest.raises(ValueError, match="state_indices"):
        kda_ops.chunk_kda_update_(**x, state_pool=pool, state_indices=torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match="state_indices"):
        kda_ops.chunk_kda_update_(**x, state_pool=pool, state_indices=torch.tensor([3, 3]))
    with pytest.raises(TypeError, match="state_pool"):
        kda_ops.chunk_kda_update_(**x, state_pool=pool.half(), state_indices=torch.tensor([0, 1]))


def test_chunk_prefill_opcheck() -> None:
    x = make_inputs(2, 70, H, K, V, HV=HV)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], make_state(S, HV, K, V), torch.tensor([4, -1]),
            K**-0.5, None, None, None, None, True, False, False, False)  # fmt: skip
    torch.library.opcheck(torch.ops.kda.chunk_update_.default, args)


def test_opcheck() -> None:
    x = make_inputs(3, 1, H, K, V, HV=HV)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], make_state(S, HV, K, V), torch.tensor([4, -1, 0]),
            K**-0.5, None, None, None, None, True, False, False, False)  # fmt: skip
    torch.library.opcheck(torch.ops.kda.recurrent_update_.default, args)
    cu = torch.tensor([0, 2, 2, 3])
    x = make_inputs(1, 3, H, K, V, HV=HV)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], make_state(S, HV, K, V), torch.tensor([4, -1, 0]),
            K**-0.5, cu, None, None, None, False, False, False, False)  # fmt: skip
    torch.library.opcheck(torch.ops.kda.recurrent_update_.default, args)
    x = make_inputs(2, 2, H, K, V, HV=HV)
    for write in (True, False):
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], make_state(S, HV, K, V), torch.tensor([[4, 1], [0, -1]]),
                K**-0.5, None, None, None, None, False, False, False, False, False, torch.tensor([2, 1]), write)
        torch.library.opcheck(torch.ops.kda.recurrent_update_.default, args)


@pytest.mark.parametrize("schedule", ["recurrent", "chunk"])
def test_compiled_decode_step_updates_the_pool_without_a_copy(schedule: str) -> None:
    """fullgraph compile: no graph break, the pool updated in place, no clone or copy of it in the code (the decode
    step, and the chunkwise prefill into the pool)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    update = kda_ops.recurrent_kda_update_ if schedule == "recurrent" else kda_ops.chunk_kda_update_

    def step(x: dict[str, torch.Tensor], pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        o = update(**x, state_pool=pool, state_indices=idx, use_qk_l2norm_in_kernel=True)
        return o * 2

    x = make_inputs(3, 1 if schedule == "recurrent" else 70, H, K, V, HV=HV)
    pool = make_state(S, HV, K, V)
    idx = torch.tensor([4, -1, 0])
    p_eager = pool.clone()
    o_eager = step(x, p_eager, idx)
    explanation = torch._dynamo.explain(step)(x, pool.clone(), idx)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    counters.clear()
    p = pool.clone()
    ptr = p.data_ptr()
    o, code = run_and_get_code(torch.compile(step, fullgraph=True), x, p, idx)
    assert p.data_ptr() == ptr
    torch.testing.assert_close(o, o_eager, rtol=0, atol=0)
    torch.testing.assert_close(p, p_eager, rtol=0, atol=0)
    assert counters["inductor"]["possibly_missed_reinplacing_opportunities"] == 0
    src = "\n".join(code)
    assert f"{schedule}_update_.default" in src
    assert "clone" not in src and "copy_" not in src, src


# -------------------------------------------------------------------------------------------- validation


def _call(**over: Any) -> Any:
    x = make_inputs(2, 1, H, K, V, HV=HV)
    args: dict[str, Any] = {**x, "state_pool": make_state(S, HV, K, V), "state_indices": torch.tensor([0, 1])}
    args.update(over)
    return kda_ops.recurrent_kda_update_(**args)


@pytest.mark.parametrize(
    ("over", "exc", "name"),
    [
        ({"state_pool": torch.zeros(S, HV, K, V + 1)}, ValueError, "state_pool"),
        ({"state_pool": torch.zeros(S, HV * K * V)}, ValueError, "state_pool"),
        ({"state_pool": torch.zeros(S, HV, K, V, dtype=torch.float16)}, TypeError, "state_pool"),
        ({"state_pool": torch.zeros(S, HV, V, K).transpose(-1, -2)}, ValueError, "state_pool"),
        ({"state_pool": torch.zeros(S, HV, K, V, dtype=torch.int32)}, TypeError, "state_pool"),
        ({"state_indices": [0, 1]}, TypeError, "state_indices"),
        ({"state_indices": torch.tensor([0.0, 1.0])}, TypeError, "state_indices"),
        ({"state_indices": torch.tensor([0, 1, 2])}, ValueError, "state_indices"),
        ({"state_indices": torch.tensor([0, S])}, ValueError, "state_indices"),
        ({"state_indices": torch.tensor([0, -2])}, ValueError, "state_indices"),
        ({"state_indices": torch.tensor([3, 3])}, ValueError, "state_indices"),
        ({"state_indices": torch.tensor([0, 1], device="meta")}, ValueError, "state_indices"),
        ({"beta": torch.rand(2, 1, HV + 1)}, ValueError, "beta"),
        ({"state_indices": torch.tensor([[0], [1], [2]])}, ValueError, "state_indices"),
        ({"state_indices": torch.tensor([[0, 1], [1, 2]])}, ValueError, "state_indices"),
        ({"num_accepted_tokens": torch.tensor([1, 1])}, ValueError, "num_accepted_tokens"),
        ({"state_indices": torch.tensor([[0, 1], [2, 3]]), "num_accepted_tokens": torch.tensor([1, 3])}, ValueError,
         "num_accepted_tokens"),
        ({"state_indices": torch.tensor([[0, 1], [2, 3]]), "num_accepted_tokens": torch.tensor([1.0, 2.0])},
         TypeError, "num_accepted_tokens"),
        ({"write_states": "no"}, TypeError, "write_states"),
    ],
)
def test_validation_names_the_argument(over: dict[str, Any], exc: type[Exception], name: str) -> None:
    with pytest.raises(exc, match=name):
        _call(**over)


def test_padding_slots_may_repeat() -> None:
    o = _call(state_indices=torch.tensor([-1, -1]))
    assert torch.equal(o, torch.zeros_like(o))


@pytest.mark.parametrize("op", [kda_ops.recurrent_kda_update_, kda_ops.chunk_kda_update_], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("name", ["q", "g", "state_pool"])
def test_an_input_that_requires_grad_is_refused_in_grad_mode(op: Any, name: str) -> None:
    """The serving steps update their pool in place and are not differentiable: in grad mode an input that
    requires grad is named (under no_grad the same call runs)."""
    x = {n: t for n, t in make_inputs(1, 6, 2, 8, 8, seed=3).items() if n in ("q", "k", "v", "g", "beta")}
    pool = make_state(2, 2, 8, 8)
    args = {**x, "state_pool": pool}
    args[name] = args[name].clone().requires_grad_()
    with pytest.raises(ValueError, match=f"^{name}: expected no tensor that requires grad"):
        op(**args, state_indices=torch.tensor([1]))
    with torch.no_grad():
        op(**args, state_indices=torch.tensor([1]))
