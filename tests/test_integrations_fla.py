"""``kda_ops.integrations.fla``: the switch for fla's KDA layer, on the CPU.

fla's layer runs only on a GPU (its short convolution and gated norm are Triton kernels), so here a stand-in
``fla.layers.kda`` module calls its kernels as fla 0.6's layer does: by the module-level names ``chunk_kda`` and
``fused_recurrent_kda``, with the layer's keywords (the gate, beta's sigmoid and the l2norm in the kernel, V-first
states). The real layer, patched against unpatched, is ``tests/gpu/test_models_gpu.py``'s.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import kda_ops
from kda_ops.integrations import fla as switch
from kda_ops.testing import make_inputs

H, D = 2, 16

LAYER_SOURCE = '''
import torch
from torch import nn


def chunk_kda(**kwargs):
    raise RuntimeError("fla's chunk_kda")


def fused_recurrent_kda(**kwargs):
    raise RuntimeError("fla's fused_recurrent_kda")


class KimiDeltaAttention(nn.Module):
    def __init__(self, H, D):
        super().__init__()
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, H)))
        self.dt_bias = nn.Parameter(torch.linspace(-1.0, 1.0, H * D))

    def forward(self, q, k, v, g, beta, state=None, recurrent=False):
        kw = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=self.A_log, dt_bias=self.dt_bias, initial_state=state,
                  output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, lower_bound=None, state_v_first=True,
                  cu_seqlens=None)
        if recurrent:
            return fused_recurrent_kda(**kw)
        return chunk_kda(safe_gate=False, **kw)
'''


def _fake_fla(monkeypatch: pytest.MonkeyPatch, source: str = LAYER_SOURCE) -> types.ModuleType:
    fla, layers, kda = (types.ModuleType(n) for n in ("fla", "fla.layers", "fla.layers.kda"))
    fla.__version__ = "0.6.0"  # type: ignore[attr-defined]
    exec(compile(source, "fla/layers/kda.py", "exec"), kda.__dict__)
    fla.layers = layers  # type: ignore[attr-defined]
    layers.kda = kda  # type: ignore[attr-defined]
    for name, module in (("fla", fla), ("fla.layers", layers), ("fla.layers.kda", kda)):
        monkeypatch.setitem(sys.modules, name, module)
    return kda


@pytest.fixture
def fla_layer(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    module = _fake_fla(monkeypatch)
    yield module
    switch.remove_kda_ops()


def _inputs() -> dict[str, torch.Tensor]:
    x = make_inputs(1, 40, H, D, D, gate_in_kernel=True, beta_logits=True, seed=3)
    return {n: x[n] for n in ("q", "k", "v", "g", "beta")}


def test_the_patched_layer_runs_kda_ops_in_both_modes(fla_layer: types.ModuleType) -> None:
    layer = fla_layer.KimiDeltaAttention(H, D)
    x = _inputs()
    with pytest.raises(RuntimeError, match="fla's chunk_kda"):
        layer(**x)
    model = nn.Sequential(nn.Identity(), layer)
    assert switch.apply_kda_ops(model) is model
    state = torch.randn(1, H, D, D)
    opts = dict(A_log=layer.A_log, dt_bias=layer.dt_bias, output_final_state=True, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True, initial_state=state)
    for recurrent, fn in ((False, kda_ops.chunk_kda), (True, kda_ops.recurrent_kda)):
        o, s = layer(**x, state=state, recurrent=recurrent)
        o_ref, s_ref = fn(**x, **opts)  # type: ignore[operator]
        assert torch.equal(o, o_ref) and s is not None and s_ref is not None and torch.equal(s, s_ref)


def test_apply_is_idempotent_and_remove_restores_fla(fla_layer: types.ModuleType) -> None:
    own = (fla_layer.chunk_kda, fla_layer.fused_recurrent_kda)
    switch.apply_kda_ops()
    switch.apply_kda_ops()
    assert fla_layer.chunk_kda is switch.KERNELS["chunk_kda"]
    switch.remove_kda_ops()
    assert (fla_layer.chunk_kda, fla_layer.fused_recurrent_kda) == own
    switch.remove_kda_ops()  # nothing to restore: a no-op
    assert fla_layer.chunk_kda is own[0]


def test_a_model_without_the_layer_is_refused(fla_layer: types.ModuleType) -> None:
    with pytest.raises(ValueError, match="model: holds no fla KimiDeltaAttention"):
        switch.apply_kda_ops(nn.Linear(2, 2))
    assert fla_layer.chunk_kda is not switch.KERNELS["chunk_kda"]


def test_an_unknown_layer_module_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _fake_fla(monkeypatch, LAYER_SOURCE.replace("def fused_recurrent_kda", "def other_kernel"))
    with pytest.raises(NotImplementedError, match="fla 0.6.0: fla.layers.kda has no fused_recurrent_kda"):
        switch.apply_kda_ops()
    assert module.chunk_kda.__module__ != switch.KERNELS["chunk_kda"].__module__


def test_without_fla_the_import_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fla", None)
    with pytest.raises(ImportError):
        switch.apply_kda_ops()
