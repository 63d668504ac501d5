"""``examples/train_hybrid.py`` runs (a few eager steps here): the hybrid LM trains, and with transformers' KDA
layers holding the same weights it takes the same steps (where transformers is installed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parent.parent / "examples" / "train_hybrid.py"


def load() -> object:
    spec = importlib.util.spec_from_file_location("train_hybrid", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_hybrid"] = module
    spec.loader.exec_module(module)
    return module


def test_a_few_steps_equal_with_transformers_layers() -> None:
    ex: object = load()
    torch.manual_seed(0)
    base = ex.kda_init(ex.HybridLM(ex.ours))  # type: ignore[attr-defined]
    start = {n: t.clone() for n, t in base.state_dict().items()}
    data = ex.batches(4, 2, 32, "cpu")  # type: ignore[attr-defined]
    ours = ex.train("ours", base, data, "cpu", compile=False)  # type: ignore[attr-defined]
    assert all(torch.isfinite(torch.tensor(ours["losses"])))
    pytest.importorskip("transformers.models.kimi_linear")
    theirs_model = ex.init_like(ex.HybridLM(ex.transformers_kda), start)  # type: ignore[attr-defined]
    theirs = ex.train("theirs", theirs_model, data, "cpu", compile=False)  # type: ignore[attr-defined]
    assert torch.allclose(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-4)
