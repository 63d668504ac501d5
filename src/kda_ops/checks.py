"""The checked mode: a debugging switch that validates, on the device and with a host synchronisation, the values
the fast path takes on trust (``cu_seqlens``, the serving step's slots, ``g``, ``beta``).

Off by default: the ops then read no value of a device tensor, and a call pays one flag test. Turn it on with
:func:`set_checks` or ``KDA_OPS_CHECKS=1`` in the environment; each public function then raises the CPU checks'
errors for bad values on any device. Eager calls only: a ``torch.compile`` trace skips the checks, and a call
inside a CUDA-graph capture raises (a capture cannot synchronise).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

_enabled = os.environ.get("KDA_OPS_CHECKS", "0") not in ("", "0")


def set_checks(enabled: bool) -> None:
    """Turn the checked mode on or off for the process."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    _enabled = enabled


def checks_enabled() -> bool:
    """Whether the checked mode is on."""
    return _enabled


def active(*tensors: Tensor | None) -> bool:
    """Whether a call on these tensors validates values now: the mode is on and the call is eager. Raises inside a
    CUDA-graph capture, which a check's host synchronisation would break."""
    if not _enabled or torch.compiler.is_compiling():
        return False
    if any(x is not None and x.is_cuda for x in tensors) and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "kda_ops checked mode: values are read on the host, which a CUDA-graph capture cannot do; "
            "turn it off (kda_ops.set_checks(False)) before capturing"
        )
    return True


def _fail(name: str, expected: str, got: object) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_gate_and_beta(g: Tensor, beta: Tensor, gate_in_kernel: bool, beta_sigmoid: bool, neg_eigval: bool) -> None:
    """``g`` a log decay (``<= 0``, no NaN; ``-inf`` is a hard reset) unless the gate is in the kernel, where it
    must not be NaN; ``beta`` in ``[0, 1]`` (``[0, 2]`` with ``neg_eigval``) unless it holds logits
    (``beta_sigmoid``), where it must not be NaN."""
    if bool(torch.isnan(g).any()):  # sync-ok: checked mode
        _fail("g", "no NaN", "NaN entries")
    if not gate_in_kernel and bool((g > 0).any()):  # sync-ok: checked mode
        _fail("g", "a log decay <= 0 (without use_gate_in_kernel)", f"a maximum of {float(g.max())}")
    if bool(torch.isnan(beta).any()):  # sync-ok: checked mode
        _fail("beta", "no NaN", "NaN entries")
    if not beta_sigmoid:
        top = 2.0 if neg_eigval else 1.0
        lo, hi = float(beta.min()), float(beta.max())  # sync-ok: checked mode
        if lo < 0 or hi > top:
            _fail("beta", f"values in [0, {top:g}] (without use_beta_sigmoid_in_kernel)", f"[{lo}, {hi}]")


__all__ = ["active", "check_gate_and_beta", "checks_enabled", "set_checks"]
