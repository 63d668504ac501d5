"""``kda_ops.warmup``: public, only a check of its arguments on the CPU, and handing each public function only the
options it takes (the warm-up on the GPU: ``tests/gpu/``)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import kda_ops
from kda_ops import _warmup
from kda_ops.testing import make_inputs
from tests.cases import option_inputs


def test_warmup_is_public_and_runs_on_the_cpu() -> None:
    x = option_inputs("l2norm", 1, 8, 1, 8, 8, HV=1)
    assert "warmup" in kda_ops.__all__
    kda_ops.warmup(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True)


def test_warmup_passes_each_function_only_its_own_options() -> None:
    """``kda_ops.warmup`` takes ``chunk_kda``'s keyword options and hands ``recurrent_kda`` and the serving step
    those each accepts: every option of ``chunk_kda`` is one of theirs or left out by name."""

    def keywords(fn: Any) -> set[str]:
        return {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}

    chunk = keywords(kda_ops.chunk_kda)
    assert chunk - set(_warmup._CHUNK_ONLY) == keywords(kda_ops.recurrent_kda)
    serving = keywords(kda_ops.recurrent_kda_update_)
    prefill = keywords(kda_ops.chunk_kda_update_)
    assert chunk - set(_warmup._NOT_SERVING) == serving - set(_warmup._SERVING_ONLY)
    assert chunk - set(_warmup._NOT_SERVING) == prefill - set(_warmup._PREFILL_ONLY)


def test_warmup_names_an_argument_that_is_not_a_tensor() -> None:
    x = option_inputs("plain", 1, 8, 1, 8, 8, HV=1)
    with pytest.raises(TypeError, match=r"^q: expected a torch.Tensor"):
        kda_ops.warmup(x["q"].tolist(), x["k"], x["v"], x["g"], x["beta"])


def test_a_misspelt_option_is_named_on_the_cpu_too() -> None:
    """warmup compiles nothing on the CPU, but it names an option that chunk_kda does not take there too."""
    x = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(TypeError, match=r"^warmup: unexpected keyword arguments \['use_qk_l2norm'\]"):
        kda_ops.warmup(**x, use_qk_l2norm=True)
    kda_ops.warmup(**x, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize(
    ("bad", "exc", "name"),
    [
        ({"use_gate_in_kernel": 1}, TypeError, "use_gate_in_kernel"),
        ({"initial_state": torch.zeros(1, 1, 4, 5)}, ValueError, "initial_state"),
        ({"scale": "x"}, TypeError, "scale"),
        ({"A_log": torch.zeros(1)}, ValueError, "A_log"),
    ],
    ids=["flag", "initial_state", "scale", "A_log"],
)
def test_warmup_checks_the_arguments_on_the_cpu(bad: dict[str, Any], exc: type[Exception], name: str) -> None:
    """The arguments as ``chunk_kda`` checks them, before anything compiles: a CPU machine shows what a GPU would."""
    x = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(exc, match=f"^{name}: expected"):
        kda_ops.warmup(**x, **bad)
