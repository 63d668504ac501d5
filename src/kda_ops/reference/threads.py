"""The thread policy of the reference's sequential loops (per token, per chunk): each step is a handful of small
tensor ops, where intra-op threads add hand-offs and, on a busy machine, wait for cores. Below
:data:`SMALL_STEP` state elements a loop runs on one thread: ``recurrent_kda`` on the CPU at B1 T1024 H4
K = V = 64 (16K elements a step) on a busy two-core machine 0.27 s, against 30.6 s with two threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SMALL_STEP = 1 << 18


@contextlib.contextmanager
def loop_threads(step_elements: int) -> Iterator[None]:
    """One intra-op thread for the body of a loop whose steps touch ``step_elements`` state elements, when that is
    below :data:`SMALL_STEP`; torch's setting otherwise (restored on exit; the setting is process-wide)."""
    n = torch.get_num_threads()
    if n == 1 or step_elements >= SMALL_STEP:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


__all__ = ["SMALL_STEP", "loop_threads"]
