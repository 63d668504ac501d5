"""``kda_ops.nn.KimiDeltaAttention``: transformers' Kimi Linear KDA layer, reproduced.

Against transformers' own ``KimiLinearDeltaAttention`` (skipped where transformers is not installed): the same
parameter names and shapes, its ``state_dict`` loaded as it is, the same outputs. Without it: packed rows equal to
one call per sequence, a padding mask equal to the unpadded call, a prefill split in two (the convolution's and the
recurrence's state carried) and decode steps equal to one prefill, clear errors for a bad state or mask.
"""

from __future__ import annotations

import pytest
import torch

from kda_ops.nn import KimiDeltaAttention, KimiState, check_transformers
from kda_ops.testing import assert_rel

HIDDEN, H, K, CONV = 32, 2, 16, 4


def layer(seed: int = 0) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    m = KimiDeltaAttention(HIDDEN, H, K, conv_size=CONV)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
        m.forget_gate.A_log.uniform_(0.0, 1.5)
        m.o_norm.weight.uniform_(0.5, 1.5)
    return m


def hidden(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hf() -> object:
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig

    check_transformers()
    config = KimiLinearConfig(hidden_size=HIDDEN, linear_num_heads=H, linear_head_dim=K, linear_conv_kernel_dim=CONV,
                              num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-5)  # fmt: skip
    return config, modeling.KimiLinearDeltaAttention(config, 0)


def loaded(hf: tuple[object, torch.nn.Module]) -> tuple[torch.nn.Module, KimiDeltaAttention]:
    """transformers' layer with random weights, and ours built from the same config with its state dict loaded."""
    config, theirs = hf
    ours = KimiDeltaAttention.from_config(config, 0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
        theirs.forget_gate.A_log.uniform_(0.0, 1.5)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def test_parameters_and_outputs_equal_transformers(hf: tuple[object, torch.nn.Module]) -> None:
    theirs, ours = loaded(hf)
    shapes = {n: tuple(p.shape) for n, p in theirs.state_dict().items()}
    assert {n: tuple(p.shape) for n, p in ours.state_dict().items()} == shapes
    x = hidden(2, 70)
    with torch.no_grad():
        assert_rel(ours(x)[0], theirs(x), 1e-5)


def test_prefill_then_decode_steps_equal_transformers(hf: tuple[object, torch.nn.Module]) -> None:
    """Our prefill of 20 tokens and 16 decode steps against transformers' layer over all 36 (it is causal)."""
    theirs, ours = loaded(hf)
    x = hidden(2, 36, seed=3)
    with torch.no_grad():
        y, st = ours(x[:, :20], use_cache=True)
        ys = [y]
        for t in range(20, 36):
            y_t, st = ours(x[:, t : t + 1], state=st)
            ys.append(y_t)
        assert_rel(torch.cat(ys, dim=1), theirs(x), 1e-5)


def test_other_transformers_release_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers, "__version__", "4.57.0")
    with pytest.raises(NotImplementedError, match="transformers 4.57.0"):
        check_transformers()


def test_packed_rows_equal_one_call_per_sequence() -> None:
    m = layer()
    lens = [5, 0, 70, 3]
    x = hidden(1, sum(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    with torch.no_grad():
        y, s = m(x, cu_seqlens=cu, use_cache=True)
        assert s is not None
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if a == b:
                assert torch.equal(s.recurrent[n], torch.zeros_like(s.recurrent[n]))
                continue
            y_n, s_n = m(x[:, a:b], use_cache=True)
            assert s_n is not None
            assert_rel(y[:, a:b], y_n, 1e-5)
            assert_rel(s.recurrent[n : n + 1], s_n.recurrent, 1e-5)
            assert torch.allclose(s.conv[n : n + 1], s_n.conv, atol=1e-6)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_equals_the_unpadded_call(side: str) -> None:
    m = layer()
    x, pad = hidden(1, 40), hidden(1, 7, seed=2)
    padded = torch.cat([pad, x], dim=1) if side == "left" else torch.cat([x, pad], dim=1)
    real = slice(7, 47) if side == "left" else slice(0, 40)
    mask = torch.zeros(1, 47, dtype=torch.long)
    mask[:, real] = 1
    with torch.no_grad():
        y, s = m(x, use_cache=True)
        y_p, s_p = m(padded, attention_mask=mask, use_cache=True)
    assert s is not None and s_p is not None
    assert_rel(y_p[:, real], y, 1e-5)
    assert_rel(s_p.recurrent, s.recurrent, 1e-5)
    if side == "left":
        assert torch.allclose(s_p.conv, s.conv, atol=1e-6)


def test_state_carries_prefill_and_decode() -> None:
    m = layer()
    x = hidden(2, 30)
    with torch.no_grad():
        y, s = m(x, use_cache=True)
        y1, s1 = m(x[:, :17], use_cache=True)
        y2, s2 = m(x[:, 17:27], state=s1)
        ys, st = [y1, y2], s2
        for t in range(27, 30):  # decode steps, the recurrent schedule
            y_t, st = m(x[:, t : t + 1], state=st)
            ys.append(y_t)
    assert s is not None and st is not None
    assert_rel(torch.cat(ys, dim=1), y, 1e-5)
    assert_rel(st.recurrent, s.recurrent, 1e-5)
    assert torch.allclose(st.conv, s.conv, atol=1e-5)


def test_gradients_flow_to_every_parameter() -> None:
    m = layer()
    y, _ = m(hidden(1, 20), attention_mask=torch.tensor([[0] * 3 + [1] * 17]))
    y.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_bad_state_and_mask_name_the_argument() -> None:
    m = layer()
    x = hidden(2, 5)
    bad = KimiState(conv=torch.zeros(2, 3 * H * K, CONV), recurrent=torch.zeros(2, H, K, K))
    with pytest.raises(ValueError, match="state.conv"):
        m(x, state=bad)
    with pytest.raises(ValueError, match="attention_mask"):
        m(x, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, cu_seqlens=torch.tensor([0, 5, 10]))


def test_traces_without_graph_breaks() -> None:
    m = layer()
    x = hidden(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        y, s = compiled(x, attention_mask=mask, use_cache=True)
        y_e, s_e = m(x, attention_mask=mask, use_cache=True)
        y1, _ = compiled(x[:, :1], state=s_e)
    assert s is not None and s_e is not None
    assert torch.equal(y, y_e) and torch.equal(s.recurrent, s_e.recurrent)
    assert torch.equal(y1, m(x[:, :1], state=s_e)[0])


def pools(S: int = 6, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(S, 3 * H * K, CONV - 1, generator=gen),
            torch.randn(S, H, K, K, generator=gen) * 0.3)  # fmt: skip


def test_pool_form_equals_the_state_form_prefill_then_decode() -> None:
    """Slots [4, -1, 1]: the real sequences' outputs and written slots equal the state form's from the gathered
    states; the padding sequence's outputs are zeros; every other slot is unchanged bit for bit."""
    m = layer()
    conv0, rec0 = pools()
    conv_pool, state_pool = conv0.clone(), rec0.clone()
    idx = torch.tensor([4, -1, 1])
    real, slots = torch.tensor([0, 2]), torch.tensor([4, 1])
    x = hidden(3, 20)
    with torch.no_grad():
        y = m.forward_pool(x, conv_pool, state_pool, idx)
        y_ref, s = m(x[real], state=KimiState(conv=conv0[slots], recurrent=rec0[slots]))
        assert s is not None
        assert_rel(y[real], y_ref, 1e-5)
        assert torch.equal(y[1], torch.zeros_like(y[1]))
        assert_rel(state_pool[slots], s.recurrent, 1e-5)
        assert torch.allclose(conv_pool[slots], s.conv, atol=1e-6)
        rest = [0, 2, 3, 5]
        assert torch.equal(conv_pool[rest], conv0[rest]) and torch.equal(state_pool[rest], rec0[rest])
        x1 = hidden(3, 1, seed=3)  # a decode step from the pools
        y1 = m.forward_pool(x1, conv_pool, state_pool, idx)
        y1_ref, s1 = m(x1[real], state=s)
        assert s1 is not None
        assert_rel(y1[real], y1_ref, 1e-5)
        assert_rel(state_pool[slots], s1.recurrent, 1e-5)
        assert torch.allclose(conv_pool[slots], s1.conv, atol=1e-6)


def test_pool_form_packed_rows_and_all_padding() -> None:
    m = layer()
    conv0, rec0 = pools()
    cu = torch.tensor([0, 7, 7, 19])
    x = hidden(1, 19)
    conv_pool, state_pool = conv0.clone(), rec0.clone()
    with torch.no_grad():
        y = m.forward_pool(x, conv_pool, state_pool, torch.tensor([3, 0, 5]), cu_seqlens=cu)
        for (b, e), slot in zip([(0, 7), (7, 19)], [3, 5]):
            y_ref, s = m(x[:, b:e], state=KimiState(conv=conv0[slot][None], recurrent=rec0[slot][None]))
            assert s is not None
            assert_rel(y[:, b:e], y_ref, 1e-5)
            assert_rel(state_pool[slot], s.recurrent[0], 1e-5)
        # the empty sequence of slot 0 keeps its state and its convolution inputs
        assert torch.allclose(state_pool[0], rec0[0]) and torch.allclose(conv_pool[0], conv0[0])
        conv_pool, state_pool = conv0.clone(), rec0.clone()
        y = m.forward_pool(hidden(2, 1), conv_pool, state_pool, torch.tensor([-1, -1]))
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.equal(conv_pool, conv0) and torch.equal(state_pool, rec0)


def test_pool_form_errors_name_the_argument_and_it_traces() -> None:
    m = layer()
    conv_pool, state_pool = pools()
    with pytest.raises(ValueError, match="state_indices"):
        m.forward_pool(hidden(2, 3), conv_pool, state_pool, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="conv_pool"):
        m.forward_pool(hidden(2, 3), conv_pool[:, :, :1], state_pool, torch.tensor([0, 1]))
    compiled = torch.compile(m.forward_pool, fullgraph=True, backend="eager")
    c1, s1 = conv_pool.clone(), state_pool.clone()
    c2, s2 = conv_pool.clone(), state_pool.clone()
    x, idx = hidden(2, 1), torch.tensor([5, -1])
    with torch.no_grad():
        assert torch.equal(compiled(x, c1, s1, idx), m.forward_pool(x, c2, s2, idx))
    assert torch.equal(c1, c2) and torch.equal(s1, s2)


def fake_causal_conv1d(calls: list[str]) -> object:
    """A stand-in for causal-conv1d's ``causal_conv1d_fn`` on the CPU, with the real one's layout rules: a state in
    or out, or ``seq_idx``, only with the channels contiguous; ``seq_idx`` never with a state."""

    def fn(x: torch.Tensor, weight: torch.Tensor, bias: object = None, seq_idx: torch.Tensor | None = None,
           initial_states: torch.Tensor | None = None, return_final_states: bool = False,
           final_states_out: object = None, activation: str | None = None) -> object:  # fmt: skip
        B, C, T = x.shape
        W = weight.shape[1] - 1
        if seq_idx is not None or initial_states is not None or return_final_states:
            assert x.stride(1) == 1, "channel-last layout only"
        assert seq_idx is None or (initial_states is None and not return_final_states)
        assert initial_states is None or initial_states.stride(1) == 1
        segments, start = [], 0
        for t in range(1, T + 1):  # runs of equal sequence index
            if seq_idx is None and t < T or seq_idx is not None and t < T and seq_idx[0, t] == seq_idx[0, start]:
                continue
            segments.append((start, t))
            start = t
        out = torch.empty_like(x)
        pad = torch.zeros(B, C, W, dtype=x.dtype) if initial_states is None else initial_states
        for b, e in segments:
            xp = torch.cat([pad if seq_idx is None else torch.zeros(B, C, W, dtype=x.dtype), x[..., b:e]], dim=-1)
            out[..., b:e] = torch.nn.functional.conv1d(xp, weight[:, None, :], groups=C)
            last = xp[..., -W:]
        calls.append("seq_idx" if seq_idx is not None else "state" if return_final_states else "plain")
        if activation == "silu":
            out = torch.nn.functional.silu(out)
        return (out, last) if return_final_states else out

    return fn


def test_causal_conv1d_where_installed_gives_the_same_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """With causal-conv1d present (a stand-in here), the dense forms, the state carried into decode steps and packed
    rows without a state take it; packed rows with a state fall back to the plain convolution; every output and
    state equals the plain convolution's."""
    import kda_ops.nn as knn

    m = layer()
    x, xp, cu = hidden(2, 30), hidden(1, 25, seed=4), torch.tensor([0, 10, 25])

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            y, s = m(x, use_cache=True)
            y2, s2 = m(x[:, :1], state=s)
            yp, _ = m(xp, cu_seqlens=cu)
            ypc, sp = m(xp, cu_seqlens=cu, use_cache=True)
        assert s is not None and s2 is not None and sp is not None
        return [m(x)[0], y, s.conv, s.recurrent, y2, s2.conv, yp, ypc, sp.conv]

    plain = run()
    calls: list[str] = []
    fake = fake_causal_conv1d(calls)
    monkeypatch.setattr(knn, "conv1d_fn", lambda t: fake)
    fast = run()
    assert calls == ["state", "state", "seq_idx", "plain"]
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


BAD_LAYERS = {
    "no heads": ((HIDDEN, 0, K), {}, ValueError, "num_heads"),
    "head_dim over 256": ((HIDDEN, H, 300), {}, ValueError, "head_dim"),
    "size as a string": ((str(HIDDEN), H, K), {}, TypeError, "hidden_size"),
    "one tap": ((HIDDEN, H, K), {"conv_size": 1}, ValueError, "conv_size"),
    "taps as a string": ((HIDDEN, H, K), {"conv_size": "4"}, TypeError, "conv_size"),
    "eps as a string": ((HIDDEN, H, K), {"norm_eps": "x"}, TypeError, "norm_eps"),
    "negative eps": ((HIDDEN, H, K), {"norm_eps": -1.0}, ValueError, "norm_eps"),
    "positive bound": ((HIDDEN, H, K), {"lower_bound": 1.0}, ValueError, "lower_bound"),
}


@pytest.mark.parametrize("case", list(BAD_LAYERS))
def test_bad_sizes_are_named_when_the_layer_is_built(case: str) -> None:
    args, kwargs, exc, name = BAD_LAYERS[case]
    with pytest.raises(exc, match=f"^{name}: expected"):
        KimiDeltaAttention(*args, **kwargs)


def test_bad_calls_are_named() -> None:
    m = layer()
    conv_pool, state_pool = pools()
    x = hidden(2, 3)
    calls = {
        "hidden_states": (lambda: m(x.tolist()), TypeError),
        "hidden_states ": (lambda: m(x[0]), ValueError),
        "cu_seqlens": (lambda: m(x[:1], cu_seqlens=[0, 3]), TypeError),
        "state": (lambda: m(x, state=(conv_pool[:2], state_pool[:2])), TypeError),
        "state_indices": (lambda: m.forward_pool(x, conv_pool, state_pool, torch.tensor([0, 9])), ValueError),
        "state_indices ": (lambda: m.forward_pool(x, conv_pool, state_pool, torch.tensor([0.0, 1.0])), TypeError),
        "conv_pool": (lambda: m.forward_pool(x, conv_pool[:3], state_pool, torch.tensor([0, 1])), ValueError),
        "conv_pool ": (lambda: m.forward_pool(x, conv_pool.int(), state_pool, torch.tensor([0, 1])), TypeError),
        "state_pool": (lambda: m.forward_pool(x, conv_pool, state_pool[0], torch.tensor([0, 1])), ValueError),
        # checked before any work, so that none fails deep inside (the meta device stands in for another device)
        "attention_mask": (lambda: m(x, attention_mask=[[1] * 3] * 2), TypeError),
        "attention_mask ": (lambda: m(x, attention_mask=torch.ones(2, 3, device="meta")), ValueError),
        "cu_seqlens ": (lambda: m(x[:1], cu_seqlens=torch.tensor([[0, 3]])), ValueError),
        "cu_seqlens  ": (lambda: m(x[:1], cu_seqlens=torch.tensor([0.0, 3.0])), TypeError),
        "cu_seqlens   ": (lambda: m(x[:1], cu_seqlens=torch.tensor([0, 3], device="meta")), ValueError),
        "state.conv": (lambda: m(x, state=KimiState(conv_pool[:2].int(), state_pool[:2])), TypeError),
        "state.conv ": (lambda: m(x, state=KimiState(conv_pool[:2].to("meta"), state_pool[:2])), ValueError),
        "state.recurrent": (lambda: m(x, state=KimiState(conv_pool[:2], state_pool[:2].to("meta"))), ValueError),
        "conv_pool  ": (lambda: m.forward_pool(x, conv_pool.to("meta"), state_pool, torch.tensor([0, 1])), ValueError),
        "state_pool ": (lambda: m.forward_pool(x, conv_pool, state_pool.to("meta"), torch.tensor([0, 1])), ValueError),
        "state_indices  ": (lambda: m.forward_pool(x, conv_pool, state_pool, torch.tensor([0, 1], device="meta")),
                            ValueError),  # fmt: skip
    }
    for name, (call, exc) in calls.items():
        with pytest.raises(exc, match=f"^{name.strip()}: expected"):
            call()


def test_empty_inputs_pass_the_state_through() -> None:
    """No tokens (T = 0), no sequences (B = 0) or packed empty sequences: empty outputs, the state unchanged."""
    m = layer()
    conv, rec = pools(2)
    y, s = m(hidden(2, 0), state=KimiState(conv=conv, recurrent=rec))
    assert y.shape == (2, 0, HIDDEN) and s is not None
    assert torch.equal(s.conv, conv) and torch.equal(s.recurrent, rec)
    assert s.conv is not conv and s.recurrent is not rec  # new tensors, as after any call
    assert m(hidden(0, 5))[0].shape == (0, 5, HIDDEN)
    y, s = m(hidden(1, 0), cu_seqlens=torch.tensor([0, 0, 0]), use_cache=True)
    assert y.shape == (1, 0, HIDDEN) and s is not None and s.recurrent.shape == (2, H, K, K)


def test_the_pool_form_runs_without_autograd() -> None:
    """The serving form updates its pools in place: in grad mode it records nothing and its output carries no
    gradient (the serving ops refuse inputs that require grad)."""
    m = layer()
    conv_pool, state_pool = pools()
    y = m.forward_pool(hidden(2, 3), conv_pool, state_pool, torch.tensor([0, 1]))
    assert not y.requires_grad


def test_export_takes_and_returns_the_state() -> None:
    """torch.export of a prefill that returns the state, then of a decode step from it: KimiState is a pytree node."""

    class Prefill(torch.nn.Module):
        def __init__(self, m: KimiDeltaAttention) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, KimiState | None]:
            return self.m(x, use_cache=True)

    class Step(Prefill):
        def forward(self, x: torch.Tensor, state: KimiState) -> tuple[torch.Tensor, KimiState | None]:  # type: ignore[override]
            return self.m(x, state=state)

    m = layer()
    x, x1 = hidden(2, 7), hidden(2, 1, seed=4)
    y, s = torch.export.export(Prefill(m), (x,)).module()(x)
    y_ref, s_ref = m(x, use_cache=True)
    assert isinstance(s, KimiState) and s_ref is not None
    assert torch.allclose(y, y_ref) and torch.allclose(s.recurrent, s_ref.recurrent)
    y1, s1 = torch.export.export(Step(m), (x1, s)).module()(x1, s)
    y1_ref, s1_ref = m(x1, state=s_ref)
    assert isinstance(s1, KimiState) and s1_ref is not None
    assert torch.allclose(y1, y1_ref, atol=1e-6) and torch.allclose(s1.conv, s1_ref.conv)
