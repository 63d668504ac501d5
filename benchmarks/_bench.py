"""What the benchmark scripts share: the peer's import from carried wheels, and host timing."""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from typing import Any

import torch


def _import_fla(name: str) -> tuple[Callable[..., Any], str]:
    fla = importlib.import_module("fla")
    fn: Callable[..., Any] = getattr(importlib.import_module("fla.ops.kda"), name)
    return fn, str(getattr(fla, "__version__", "?"))


def load_fla(wheels: list[str], name: str) -> tuple[Callable[..., Any] | None, str]:
    """``fla.ops.kda.<name>`` and where it came from (or why it is missing): from the environment, else from
    ``wheels`` (fla-core and its dependencies) unpacked into a temporary folder."""
    try:
        fn, version = _import_fla(name)
        return fn, f"fla {version} (installed)"
    except Exception as e:  # noqa: BLE001 - any import failure means "not in this environment"
        reason = f"{type(e).__name__}: {e}"
    if not wheels:
        return None, f"fla not importable ({reason}) and no wheels given"
    site = tempfile.mkdtemp(prefix="bench-wheels-")
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    sys.path.insert(0, site)
    for mod in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[mod]
    try:
        fn, version = _import_fla(name)
        return fn, f"fla {version} (from {', '.join(os.path.basename(w) for w in wheels)})"
    except Exception as e:  # noqa: BLE001
        return None, f"fla not importable: {type(e).__name__}: {e}"


def host_us(fn: Callable[[], Any], iters: int = 500) -> float:
    """Host µs per call of back-to-back calls, synchronised at the ends only."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6
