"""Fixtures of the Triton kernel tests (``tests/triton/``, mirroring ``src/kda_ops/triton/``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kda_ops.common import triton_usable

# Without a triton the kernels support, their tests are not collected: their modules import the kernels.
collect_ignore_glob = [] if triton_usable() else ["test_*.py", "*/test_*.py"]


@pytest.fixture
def triton_path() -> Iterator[None]:
    """The ops routed to the Triton kernels on the CPU (the interpreter), and every launcher's outputs and scratch
    buffers poisoned with NaN first, so that an element a kernel forgets to write fails the comparison."""
    from kda_ops import ops
    from kda_ops.triton.launch import poison_outputs

    with ops.cpu_backend("triton"), poison_outputs():
        yield
