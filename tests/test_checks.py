"""The checked mode (``kda_ops.set_checks``, ``KDA_OPS_CHECKS=1``): off by default; on, a bad ``g`` or ``beta``
raises a ValueError naming it in every public function; a hard reset (``g = -inf``) and logits (with the sigmoid
in kernel) pass."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kda_ops
from kda_ops.testing import make_inputs


def _inputs() -> dict[str, torch.Tensor]:
    x = make_inputs(1, 20, 1, 8, 8, seed=1)
    return {n: x[n] for n in ("q", "k", "v", "g", "beta")}


def _serve(**x: Any) -> Any:
    pool = torch.zeros(1, 1, 8, 8)
    return kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=torch.tensor([0]))


FUNCTIONS: list[Callable[..., Any]] = [kda_ops.chunk_kda, kda_ops.recurrent_kda, _serve]
IDS = ["chunk", "recurrent", "serving"]

BAD: dict[str, tuple[str, Callable[[dict[str, torch.Tensor]], None], dict[str, Any]]] = {
    "g positive": ("g", lambda x: x["g"].__setitem__((0, 3, 0, 1), 0.5), {}),
    "g NaN": ("g", lambda x: x["g"].__setitem__((0, 3, 0, 1), float("nan")), {}),
    "g NaN with the gate in kernel": ("g", lambda x: x["g"].__setitem__((0, 3, 0, 1), float("nan")),
                                      {"use_gate_in_kernel": True, "A_log": torch.zeros(1)}),
    "beta above 1": ("beta", lambda x: x["beta"].__setitem__((0, 2, 0), 1.5), {}),
    "beta above 2 with negative eigenvalues": ("beta", lambda x: x["beta"].__setitem__((0, 2, 0), 2.5),
                                               {"allow_neg_eigval": True}),
    "beta negative": ("beta", lambda x: x["beta"].__setitem__((0, 2, 0), -0.1), {}),
}  # fmt: skip


def test_off_by_default() -> None:
    assert not kda_ops.checks_enabled()


@pytest.mark.parametrize("fn", FUNCTIONS, ids=IDS)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_are_named(case: str, fn: Callable[..., Any], checked: None) -> None:
    name, spoil, kwargs = BAD[case]
    x = _inputs()
    spoil(x)
    with torch.no_grad(), pytest.raises(ValueError, match=f"^{name}:"):
        fn(**x, **kwargs)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=IDS)
def test_good_values_pass(fn: Callable[..., Any], checked: None) -> None:
    x = _inputs()
    x["g"][0, 5] = -torch.inf  # a hard reset is a valid log decay
    with torch.no_grad():
        fn(**x)
        fn(**{**x, "beta": x["beta"] * 4 - 2}, use_beta_sigmoid_in_kernel=True)  # logits of any sign
        fn(**{**x, "beta": x["beta"] * 2}, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=True)


def test_bad_beta_passes_when_off() -> None:
    """Off, the values are the caller's contract: nothing is read."""
    x = _inputs()
    x["beta"][0, 2, 0] = 1.5
    with torch.no_grad():
        kda_ops.recurrent_kda(**x)


def test_the_environment_turns_it_on() -> None:
    code = "import kda_ops, sys; sys.exit(0 if kda_ops.checks_enabled() else 1)"
    env = {**os.environ, "KDA_OPS_CHECKS": "1"}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


def test_set_checks_takes_a_bool() -> None:
    with pytest.raises(TypeError, match="enabled"):
        kda_ops.set_checks(1)  # type: ignore[arg-type]
