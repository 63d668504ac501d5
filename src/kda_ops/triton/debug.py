"""Test hooks for the Triton launchers: poison every buffer a kernel must write before it runs.

Outputs are allocated with ``torch.empty`` (no fill: the fill would cost a kernel launch per call). A kernel that
forgets to write an element then returns whatever the allocator held, which a test may never notice. Inside
:func:`poison_outputs` the launchers fill their outputs (and every scratch buffer that a kernel must fully write
before it is read back) with NaN before the kernel runs, so a missed element fails any comparison.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

_poison = False


@contextlib.contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    """Fill the outputs of every Triton launcher with NaN (or -1 for integer buffers) before its kernel runs."""
    global _poison
    old, _poison = _poison, enabled
    try:
        yield
    finally:
        _poison = old


def poison(*tensors: Tensor | None) -> None:
    """Fill ``tensors`` with NaN when :func:`poison_outputs` is active; a no-op (one bool test) otherwise."""
    if not _poison:
        return
    for t in tensors:
        if t is not None and t.numel() > 0:
            t.fill_(float("nan") if t.is_floating_point() else -1)
