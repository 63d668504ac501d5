"""``kda_ops.compat.fla``: fla-core 0.6.0's ``fla.ops.kda`` signatures on kda-ops. Each function is called as the
peer's docstrings call it (smaller sizes, float32 on the CPU) and must equal the native call; each accepted tuning
option leaves the result as it is; each refused option raises, naming it."""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda_ops
from kda_ops.compat import fla
from kda_ops.testing import make_inputs

B, T, H, HV, K, V = 2, 12, 2, 4, 8, 8
EMPTY = inspect.Parameter.empty
KW = inspect.Parameter.VAR_KEYWORD

# The peer's signatures: (name, default) in positional order, **kwargs last.
SIGNATURES: dict[str, list[tuple[str, Any]]] = {
    "chunk_kda": [
        ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("g", EMPTY), ("beta", EMPTY), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
        ("safe_gate", False), ("lower_bound", None), ("disable_recompute", False),
        ("return_intermediate_states", False), ("state_v_first", False), ("cu_seqlens", None),
        ("cu_seqlens_cpu", None), ("cp_context", None), ("use_graph", False), ("max_num_seqs", None),
        ("kwargs", KW),
    ],
    "fused_recurrent_kda": [
        ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("g", EMPTY), ("beta", EMPTY), ("A_log", None), ("dt_bias", None),
        ("scale", None), ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
        ("lower_bound", None), ("state_v_first", False), ("cu_seqlens", None), ("kwargs", KW),
    ],
    "fused_kda_gate": [
        ("g", EMPTY), ("A_log", None), ("dt_bias", None), ("lower_bound", None), ("output_dtype", torch.float32),
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", SIGNATURES)
def test_signature_is_the_peers(name: str) -> None:
    params = list(inspect.signature(getattr(fla, name)).parameters.values())
    got = [(p.name, KW if p.kind is KW else p.default) for p in params]
    assert got == SIGNATURES[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params if p.kind is not KW)


def _chunk_doc_inputs(hv: int = H) -> dict[str, torch.Tensor]:
    """The tensors of the peer's ``chunk_kda`` example: raw gate input ``rand``, ``A_log`` and ``dt_bias``."""
    return {
        "q": torch.randn(B, T, H, K), "k": torch.randn(B, T, H, K), "v": torch.randn(B, T, hv, V),
        "beta": torch.rand(B, T, hv), "g": torch.rand(B, T, hv, K), "h0": torch.randn(B, hv, K, V),
        "A_log": torch.randn(hv), "dt_bias": torch.randn(hv * K),
    }  # fmt: skip


def _same(a: tuple[torch.Tensor, torch.Tensor | None], b: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """Bit for bit: the compat call is the native call."""
    assert torch.equal(a[0], b[0])
    assert (a[1] is None) == (b[1] is None)
    if a[1] is not None and b[1] is not None:
        assert torch.equal(a[1], b[1])


@pytest.mark.parametrize("hv", [H, 2 * H], ids=["MHA", "GVA"])
def test_chunk_kda_as_the_peers_docstring_calls_it(hv: int) -> None:
    x = _chunk_doc_inputs(hv)
    o, ht = fla.chunk_kda(
        q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
    )  # fmt: skip
    native = kda_ops.chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
    )  # fmt: skip
    assert o.shape == (B, T, hv, V) and ht is not None and ht.shape == (B, hv, K, V)
    _same((o, ht), native)


def test_chunk_kda_varlen_as_the_peers_docstring_calls_it() -> None:
    x = _chunk_doc_inputs()
    q, k, v, beta, g = (t.reshape(1, B * T, *t.shape[2:]) for t in (x["q"], x["k"], x["v"], x["beta"], x["g"]))
    cu_seqlens = q.new_tensor([0, T, 2 * T], dtype=torch.long)
    o, ht = fla.chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, cu_seqlens=cu_seqlens, A_log=x["A_log"], dt_bias=x["dt_bias"],
    )  # fmt: skip
    native = kda_ops.chunk_kda(
        q, k, v, g, beta, initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, cu_seqlens=cu_seqlens, A_log=x["A_log"], dt_bias=x["dt_bias"],
    )  # fmt: skip
    _same((o, ht), native)


def _recurrent_doc_inputs() -> dict[str, torch.Tensor]:
    """The tensors of the peer's ``fused_recurrent_kda`` example."""
    return {
        "q": torch.randn(B, T, H, K), "k": F.normalize(torch.randn(B, T, H, K), p=2, dim=-1),
        "v": torch.randn(B, T, HV, V), "g": F.logsigmoid(torch.rand(B, T, HV, K)),
        "beta": torch.rand(B, T, HV).sigmoid(), "h0": torch.randn(B, HV, K, V),
    }  # fmt: skip


def test_fused_recurrent_kda_as_the_peers_docstring_calls_it() -> None:
    x = _recurrent_doc_inputs()
    q, k, v, g, beta, h0 = x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"]
    o, ht = fla.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    _same((o, ht), kda_ops.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True))
    q, k, v, g, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta))
    cu_seqlens = q.new_tensor([0, T, 2 * T], dtype=torch.long)
    o_var, ht_var = fla.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu_seqlens)  # fmt: skip
    native = kda_ops.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    _same((o_var, ht_var), native)
    torch.testing.assert_close(o_var, o.reshape(1, B * T, HV, V))  # the packed rows are the batch's rows


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_fused_kda_gate_is_kda_gate(lower_bound: float | None) -> None:
    g = torch.randn(B, T, HV, K)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    assert torch.equal(fla.fused_kda_gate(g, A_log, dt_bias, lower_bound),
                       kda_ops.kda_gate(g, A_log, dt_bias, lower_bound))  # fmt: skip
    y = fla.fused_kda_gate(g, A_log.view(1, HV), dt_bias.view(HV, K), lower_bound, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, kda_ops.kda_gate(g, A_log, dt_bias, lower_bound).bfloat16())


def test_fused_kda_gate_gradients_in_the_parameters_shapes() -> None:
    g = torch.randn(B, T, HV, K, requires_grad=True)
    A_log, dt_bias = torch.randn(1, HV, requires_grad=True), torch.randn(HV, K, requires_grad=True)
    fla.fused_kda_gate(g, A_log, dt_bias).sum().backward()
    assert A_log.grad is not None and A_log.grad.shape == (1, HV)
    assert dt_bias.grad is not None and dt_bias.grad.shape == (HV, K)


def test_scale_is_positional_as_in_the_peer() -> None:
    x = _recurrent_doc_inputs()
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    _same(fla.chunk_kda(q, k, v, g, beta, 0.3), kda_ops.chunk_kda(q, k, v, g, beta, scale=0.3))
    _same(fla.fused_recurrent_kda(q, k, v, g, beta, None, None, 0.3),
          kda_ops.recurrent_kda(q, k, v, g, beta, scale=0.3))  # fmt: skip
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    raw = torch.randn_like(g)
    _same(fla.fused_recurrent_kda(q, k, v, raw, beta, A_log, dt_bias, 0.3, None, False, False, True),
          kda_ops.recurrent_kda(q, k, v, raw, beta, scale=0.3, use_gate_in_kernel=True, A_log=A_log,
                                dt_bias=dt_bias))  # fmt: skip


def _packed() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    x = _chunk_doc_inputs()
    packed = {n: t.reshape(1, B * T, *t.shape[2:]) for n, t in x.items() if n in ("q", "k", "v", "g", "beta")}
    packed["g"] = F.logsigmoid(packed["g"]).clamp(min=-5.0)  # a bounded gate, as safe_gate asks of a given g
    # the last sequence is empty: a cu_seqlens padded to max_num_seqs + 1 entries, as use_graph asks
    return packed, torch.tensor([0, 5, 2 * T, 2 * T])


TUNING: dict[str, dict[str, Any]] = {
    "chunk_size=32": {"chunk_size": 32},
    "chunk_size=64": {"chunk_size": 64},
    "safe_gate": {"safe_gate": True},
    "disable_recompute": {"disable_recompute": True},
    "cu_seqlens_cpu": {"cu_seqlens_cpu": "cu"},
    "use_graph": {"use_graph": True},
    "use_graph, max_num_seqs": {"use_graph": True, "max_num_seqs": 3},
    "max_num_seqs": {"max_num_seqs": 3},
    "transpose_state_layout=False": {"transpose_state_layout": False},
}


@pytest.mark.parametrize("option", TUNING)
def test_chunk_kda_accepts_each_tuning_option(option: str) -> None:
    x, cu = _packed()
    over = {n: (cu if val == "cu" else val) for n, val in TUNING[option].items()}
    h0 = torch.randn(3, H, K, V)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # transpose_state_layout's rename
        got = fla.chunk_kda(**leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu, **over)
    native = kda_ops.chunk_kda(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    _same((got[0].detach(), got[1]), native)
    got[0].sum().backward()  # differentiable whatever the option
    assert all(t.grad is not None for t in leaves.values())


def test_safe_gate_with_the_in_kernel_gate_is_the_sigmoid_gate() -> None:
    x = _chunk_doc_inputs()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    got = fla.chunk_kda(*args, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=x["A_log"],
                        dt_bias=x["dt_bias"])  # fmt: skip
    _same(got, kda_ops.chunk_kda(*args, use_gate_in_kernel=True, lower_bound=-5.0, A_log=x["A_log"],
                                 dt_bias=x["dt_bias"]))  # fmt: skip


def test_gate_parameters_are_ignored_without_the_in_kernel_gate() -> None:
    x = _recurrent_doc_inputs()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    _same(fla.chunk_kda(*args, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0), kda_ops.chunk_kda(*args))
    _same(fla.fused_recurrent_kda(*args, A_log, dt_bias, lower_bound=-5.0), kda_ops.recurrent_kda(*args))


def test_allow_neg_eigval_with_the_beta_sigmoid() -> None:
    x = _recurrent_doc_inputs()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    opts = {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}
    _same(fla.chunk_kda(*args, **opts), kda_ops.chunk_kda(*args, **opts))
    _same(fla.fused_recurrent_kda(*args, **opts), kda_ops.recurrent_kda(*args, **opts))


def test_inputs_with_T_below_H_are_read_as_B_T_H_K_without_a_warning() -> None:
    """The peer neither detects nor transposes head-first inputs: a [B, H, T, K]-looking tensor (T < H) is read
    as [B, T, H, K], as the peer reads it."""
    q, k = torch.randn(1, 3, 8, K), torch.randn(1, 3, 8, K)
    v, g, beta = torch.randn(1, 3, 8, V), F.logsigmoid(torch.randn(1, 3, 8, K)), torch.rand(1, 3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(fla.chunk_kda(q, k, v, g, beta), kda_ops.chunk_kda(q, k, v, g, beta))
        _same(fla.fused_recurrent_kda(q, k, v, g, beta), kda_ops.recurrent_kda(q, k, v, g, beta))


REFUSED: dict[str, tuple[str, dict[str, Any], type[Exception], str]] = {
    "chunk cp_context": ("chunk_kda", {"cp_context": object()}, NotImplementedError, "cp_context"),
    "recurrent ssm_state_indices": ("fused_recurrent_kda", {"ssm_state_indices": torch.zeros(B, 1, dtype=torch.int32)},
                                    NotImplementedError, "ssm_state_indices"),
    "recurrent ssm_state_indices 1-D": ("fused_recurrent_kda", {"ssm_state_indices": torch.arange(B)},
                                        NotImplementedError, "ssm_state_indices"),
    "recurrent num_accepted_tokens": ("fused_recurrent_kda", {"num_accepted_tokens": torch.ones(B, dtype=torch.int32)},
                                      NotImplementedError, "num_accepted_tokens"),
    "recurrent per-channel beta": ("fused_recurrent_kda", {"beta": torch.rand(B, T, HV, V)}, NotImplementedError,
                                   "beta"),
    "recurrent beta [B, T, HV, 1]": ("fused_recurrent_kda", {"beta": torch.rand(B, T, HV, 1)}, ValueError, "beta"),
    # the peer's own checks of its tuning options
    "chunk_size 16": ("chunk_kda", {"chunk_size": 16}, ValueError, "chunk_size"),
    "safe_gate without lower_bound": ("chunk_kda", {"safe_gate": True, "use_gate_in_kernel": True, "A_log": "A"},
                                      ValueError, "lower_bound"),
    "safe_gate lower_bound -6": ("chunk_kda", {"safe_gate": True, "use_gate_in_kernel": True, "lower_bound": -6.0},
                                 ValueError, "lower_bound"),
    "use_graph, cu_seqlens not max_num_seqs + 1": ("chunk_kda", {"use_graph": True, "max_num_seqs": 4, "cu": True},
                                                   ValueError, "cu_seqlens"),
    "safe_gate lower_bound a string": ("chunk_kda", {"safe_gate": True, "use_gate_in_kernel": True, "A_log": "A",
                                                     "lower_bound": "x"}, TypeError, "lower_bound"),
    "safe_gate not a bool": ("chunk_kda", {"safe_gate": "no"}, TypeError, "safe_gate"),
    "use_graph not a bool": ("chunk_kda", {"use_graph": 3}, TypeError, "use_graph"),
    "max_num_seqs a string": ("chunk_kda", {"max_num_seqs": "x"}, TypeError, "max_num_seqs"),
    "max_num_seqs 0": ("chunk_kda", {"max_num_seqs": 0}, ValueError, "max_num_seqs"),
    "cu_seqlens a list": ("chunk_kda", {"use_graph": True, "max_num_seqs": 4, "cu_seqlens": [0, 4, 8]}, TypeError,
                          "cu_seqlens"),
    "cu_seqlens_cpu without cu_seqlens": ("chunk_kda", {"cu_seqlens_cpu": torch.tensor([0, 4])}, ValueError,
                                          "cu_seqlens_cpu"),
    "cu_seqlens_cpu stale": ("chunk_kda", {"cu": True, "cu_seqlens_cpu": torch.tensor([0, 1, 2 * T])}, ValueError,
                             "cu_seqlens_cpu"),
    "chunk allow_neg_eigval without sigmoid": ("chunk_kda", {"allow_neg_eigval": True}, ValueError, "allow_neg_eigval"),
    "recurrent allow_neg_eigval without sigmoid": ("fused_recurrent_kda", {"allow_neg_eigval": True}, ValueError,
                                                   "allow_neg_eigval"),
    "state_v_first and transpose_state_layout": ("chunk_kda", {"state_v_first": True, "transpose_state_layout": True},
                                                 ValueError, "chunk_kda"),
    "chunk unknown keyword": ("chunk_kda", {"head_first": True}, TypeError, "chunk_kda"),
    "recurrent unknown keyword": ("fused_recurrent_kda", {"out": torch.zeros(1)}, TypeError, "fused_recurrent_kda"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_each_refused_option_raises_naming_it(case: str) -> None:
    name, over, exc, named = REFUSED[case]
    x = _recurrent_doc_inputs()
    args: dict[str, Any] = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    if over.pop("cu", False):
        args = {n: t.reshape(1, B * T, *t.shape[2:]) for n, t in args.items()}
        args["cu_seqlens"] = torch.tensor([0, T, 2 * T])
    if over.get("A_log") == "A":
        over["A_log"] = torch.randn(HV)
    args.update(over)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(exc, match=rf"^{re.escape(named)}"):
            getattr(fla, name)(**args)


def test_transpose_state_layout_is_a_deprecated_name() -> None:
    x = _recurrent_doc_inputs()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        _same(fla.fused_recurrent_kda(*args, transpose_state_layout=False), kda_ops.recurrent_kda(*args))


@pytest.mark.parametrize("name", ["state_v_first", "transpose_state_layout"])
@pytest.mark.parametrize("fn", ["chunk_kda", "fused_recurrent_kda"])
def test_state_v_first_is_kda_ops_state_v_first(fn: str, name: str) -> None:
    """The peer's V-first layout (or its deprecated name) is kda-ops' own: states [N, HV, V, K] in and out."""
    x = _recurrent_doc_inputs()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    h0 = torch.randn(B, HV, V, K)
    ours = {"chunk_kda": kda_ops.chunk_kda, "fused_recurrent_kda": kda_ops.recurrent_kda}[fn]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = getattr(fla, fn)(*args, initial_state=h0, output_final_state=True, **{name: True})
    _same(got, ours(*args, initial_state=h0, output_final_state=True, state_v_first=True))
    assert got[1] is not None and got[1].shape == (B, HV, V, K)


def test_compile_fullgraph_of_the_compat_functions() -> None:
    torch._dynamo.reset()
    x = _chunk_doc_inputs(HV)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw: torch.Tensor, beta: torch.Tensor,
             A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
        g = fla.fused_kda_gate(raw, A_log, dt_bias)
        o, _ = fla.chunk_kda(q, k, v, g, beta, chunk_size=32, safe_gate=False, disable_recompute=True)
        o1, _ = fla.fused_recurrent_kda(q, k, v, raw, beta, A_log, dt_bias, use_gate_in_kernel=True)
        return o + o1

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"])
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), step(*args))


def test_intermediate_states_as_the_peer_returns_them() -> None:
    """``return_intermediate_states``: ``(o, final, h)``; packed with ``cu_seqlens_cpu``, ``h`` holds the chunks of
    all sequences only, as the peer's."""
    x = make_inputs(1, 200, 2, 16, 16, seed=11)
    cu = torch.tensor([0, 70, 200])
    with torch.inference_mode():
        o, _, h = fla.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, cu_seqlens_cpu=cu,
                                return_intermediate_states=True)  # fmt: skip
        o2, _, h2 = kda_ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                      return_intermediate_states=True)  # fmt: skip
    assert torch.equal(o, o2)
    assert h.shape == (1, 2 + 3, 2, 16, 16) and torch.equal(h, h2[:, :5])
