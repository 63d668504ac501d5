"""On the GPU: KDA inside compiled models, CUDA graphs and torch.export, with no graph break or sync."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import kda_ops
from kda_ops.nn import KDALayer
from kda_ops.testing import make_inputs, make_state, rel_err
from tests._models import TinyKDAModel, copy_task, lm_loss

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _model(seed: int = 0) -> TinyKDAModel:
    torch.manual_seed(seed)
    return TinyKDAModel(vocab=128, hidden=128, heads=2, head_dim=64, layers=2).to(DEV)


def test_training_step_fullgraph_no_graph_breaks_equal_to_eager() -> None:
    torch._dynamo.reset()
    model = _model()
    tokens = copy_task(4, 128, 128, DEV, seed=0)

    def loss_fn(m: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
        return lm_loss(m(t)[0], t)

    explain = torch._dynamo.explain(loss_fn)(model, tokens)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    compiled = torch.compile(loss_fn, fullgraph=True)
    ref_model = _model()
    loss = loss_fn(ref_model, tokens)
    loss.backward()
    loss_c = compiled(model, tokens)
    loss_c.backward()
    assert rel_err(loss_c, loss) < 1e-4
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        assert p.grad is not None and p_ref.grad is not None
        assert rel_err(p.grad, p_ref.grad) < 1e-3, name


def test_compiled_training_loss_decreases() -> None:
    torch._dynamo.reset()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = copy_task(8, 128, 128, DEV, seed=1)

    @torch.compile(fullgraph=True)
    def loss_fn(t: torch.Tensor) -> torch.Tensor:
        return lm_loss(model(t)[0], t)

    losses = []
    for _ in range(50):
        loss = loss_fn(tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_prefill_and_decode_reduce_overhead_equal_to_eager() -> None:
    torch._dynamo.reset()
    model = _model().eval()
    tokens = copy_task(2, 64, 128, DEV, seed=2)
    with torch.no_grad():
        logits_ref, _ = model(tokens)
        prefill = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        decode = torch.compile(lambda t, s: model(t, s, recurrent=True), mode="reduce-overhead", fullgraph=True)
        _, states = prefill(tokens[:, :48])
        states = [s.clone() for s in states]  # reduce-overhead outputs are reused by the next replay
        outs = []
        for t in range(48, 64):
            logits, states = decode(tokens[:, t : t + 1], states)
            outs.append(logits.clone())
            states = [s.clone() for s in states]
    assert rel_err(torch.cat(outs, 1), logits_ref[:, 48:]) < 1e-3


def test_no_recompile_on_cu_seqlens_values_and_one_on_T() -> None:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    layer = KDALayer(128, 2, 64).to(DEV)
    f = torch.compile(lambda x, cu: layer(x, cu_seqlens=cu)[0], backend=counter, fullgraph=True)
    x = torch.randn(1, 256, 128, device=DEV)
    for cu in ([0, 100, 256], [0, 0, 256], [0, 255, 256], [0, 7, 256]):
        cu_t = torch.tensor(cu, device=DEV, dtype=torch.int32)
        assert rel_err(f(x, cu_t), layer(x, cu_seqlens=cu_t)[0]) < 1e-4
    assert counter.frame_count == 1
    torch._dynamo.reset()
    counter2 = CompileCounterWithBackend("inductor")
    g = torch.compile(lambda x: layer(x)[0], backend=counter2, fullgraph=True)
    for T in (64, 100, 300):
        xt = torch.randn(2, T, 128, device=DEV)
        torch._dynamo.mark_dynamic(xt, 1)
        assert rel_err(g(xt), layer(xt)[0]) < 1e-4
    assert counter2.frame_count <= 2  # the first call, and at most one recompile when T changes


def test_export_layer_on_gpu() -> None:
    layer = KDALayer(128, 2, 64, num_v_heads=4).to(DEV)
    x = torch.randn(2, 100, 128, device=DEV)
    ep = torch.export.export(layer, (x,))
    assert rel_err(ep.module()(x)[0], layer(x)[0]) < 1e-5


def _op_args(x: dict[str, Any], h0: torch.Tensor | None, cu: torch.Tensor | None) -> tuple[Any, ...]:
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.25, h0, cu, x.get("A_log"), x.get("dt_bias"), None, True,
            True, "A_log" in x, True, False)  # fmt: skip


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_cuda(op: str, varlen: bool) -> None:
    x = make_inputs(1 if varlen else 2, 40, 2, 32, 32, HV=4, dtype=torch.bfloat16, device=DEV, gate_in_kernel=True,
                    beta_logits=True)  # fmt: skip
    cu = torch.tensor([0, 13, 13, 40], device=DEV) if varlen else None
    h0 = make_state(3 if varlen else 2, 4, 32, 32, device=DEV)
    for t in (*x.values(), h0):
        t.requires_grad_()
    torch.library.opcheck(getattr(torch.ops.kda, op).default, _op_args(x, h0, cu))


@pytest.mark.parametrize("schedule", ["chunk_kda", "recurrent_kda"])
def test_sync_free_forward_and_backward(schedule: str) -> None:
    fn = getattr(kda_ops, schedule)
    x = make_inputs(1, 300, 2, 64, 64, HV=4, dtype=torch.bfloat16, device=DEV, gate_in_kernel=True,
                    beta_logits=True)  # fmt: skip
    cu = torch.tensor([0, 1, 1, 150, 300], device=DEV, dtype=torch.int32)
    h0 = make_state(4, 4, 64, 64, device=DEV)
    leaves = [t.requires_grad_() for t in (*x.values(), h0)]
    kw = dict(A_log=leaves[5], dt_bias=leaves[6], initial_state=leaves[7], cu_seqlens=cu, output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)  # fmt: skip

    def run() -> None:
        o, s = fn(*leaves[:5], **kw)
        torch.autograd.backward([o, s], [torch.ones_like(o), torch.ones_like(s)])

    run()  # compile and tune the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_kimi_layer_pool_decode_step_in_a_cuda_graph() -> None:
    """``KimiDeltaAttention.forward_pool``'s decode step (bf16 layer, fp32 state pool, a padding slot) captured in a
    CUDA graph and replayed twice equals the same two steps eagerly: outputs and both pools bit for bit."""
    from kda_ops.nn import KimiDeltaAttention

    torch.manual_seed(0)
    m = KimiDeltaAttention(256, 2, 128).cuda().bfloat16().eval()
    S, B = 8, 4
    conv0 = torch.randn(S, 3 * 2 * 128, 3, device="cuda", dtype=torch.bfloat16)
    rec0 = torch.randn(S, 2, 128, 128, device="cuda") * 0.1
    idx = torch.tensor([6, -1, 0, 3], device="cuda")
    xs = [torch.randn(B, 1, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    conv_e, rec_e = conv0.clone(), rec0.clone()
    with torch.no_grad():
        want = [m.forward_pool(x, conv_e, rec_e, idx) for x in xs]
        conv_g, rec_g = conv0.clone(), rec0.clone()
        x_in = torch.zeros_like(xs[0])
        m.forward_pool(x_in, conv_g.clone(), rec_g.clone(), idx)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = m.forward_pool(x_in, conv_g, rec_g, idx)
        got = []
        for x in xs:
            x_in.copy_(x)
            graph.replay()
            got.append(y.clone())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(conv_g, conv_e) and torch.equal(rec_g, rec_e)


def test_kimi_layer_with_causal_conv1d_equals_the_plain_convolution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where causal-conv1d is installed, the layer's outputs and states with it equal those of the plain
    convolution (fp32: both are exact sums of four products)."""
    pytest.importorskip("causal_conv1d")
    import kda_ops.nn as knn

    torch.manual_seed(0)
    m = knn.KimiDeltaAttention(256, 2, 128).cuda()
    x = torch.randn(2, 300, 256, device="cuda")
    with torch.no_grad():
        assert knn.conv1d_fn(x) is not None
        y, s = m(x, use_cache=True)
        y1, s1 = m(x[:, :1], state=s)
        monkeypatch.setattr(knn, "conv1d_fn", lambda t: None)
        y_p, s_p = m(x, use_cache=True)
        y1_p, s1_p = m(x[:, :1], state=s_p)
    assert s is not None and s_p is not None and s1 is not None and s1_p is not None
    for a, b in ((y, y_p), (s.conv, s_p.conv), (y1, y1_p), (s1.recurrent, s1_p.recurrent)):
        assert rel_err(a, b) < 1e-5
