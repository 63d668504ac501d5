"""``kda_ops.integrations.fla`` on fla's own KDA layer (flash-linear-attention 0.6), on the GPU: the patched layer
against the unpatched one, bf16, prefill with its gradients and a short inference call (fla's recurrent mode).

fla is taken from the environment, else from the wheels in the repository's ``.whl/`` (``pip download
flash-linear-attention==0.6.0 fla-core==0.6.0 einops --no-deps -d .whl``), unpacked into a temporary folder; without
either the tests skip. Both sides are approximate: the bound is a relative difference of 2e-2.
"""

from __future__ import annotations

import glob
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from kda_ops.integrations import fla as switch
from kda_ops.testing import rel_err

pytestmark = pytest.mark.gpu
WHEELS = Path(__file__).resolve().parent.parent.parent / ".whl"


def _fla_layer() -> Any:
    try:
        import fla.layers.kda as layer  # type: ignore[import-not-found]

        return layer
    except ImportError:
        pass
    wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
    if not any("flash_linear_attention" in w for w in wheels):
        pytest.skip("flash-linear-attention is neither installed nor in .whl/")
    site = tempfile.mkdtemp(prefix="fla-wheels-")
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    sys.path.insert(0, site)
    import fla.layers.kda as layer

    return layer


@pytest.fixture
def fla_layer() -> Any:
    layer = _fla_layer()
    yield layer
    switch.remove_kda_ops()


def _run(model: torch.nn.Module, x: torch.Tensor, grad: bool) -> dict[str, torch.Tensor]:
    model.zero_grad()
    xi = x.detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        o = model(xi)[0]
    out = {"o": o.detach().float()}
    if grad:
        o.float().square().mean().backward()
        out["dx"] = xi.grad.float()  # type: ignore[union-attr]
        out.update({"d" + n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    return out


def test_patched_layer_matches_fla_in_training_and_inference(fla_layer: Any) -> None:
    torch.manual_seed(0)
    model = fla_layer.KimiDeltaAttention(hidden_size=512, head_dim=128, num_heads=4, mode="chunk").cuda().bfloat16()
    x = torch.randn(2, 1000, 512, device="cuda", dtype=torch.bfloat16)
    short = torch.randn(2, 48, 512, device="cuda", dtype=torch.bfloat16)
    model.train()
    ref = _run(model, x, True)
    model.eval()
    ref_short = _run(model, short, False)
    switch.apply_kda_ops(model)
    model.train()
    got = _run(model, x, True)
    model.eval()
    got_short = _run(model, short, False)
    errs = {n: rel_err(got[n], ref[n]) for n in ref} | {"o short": rel_err(got_short["o"], ref_short["o"])}
    assert all(e < 2e-2 for e in errs.values()), errs
