"""Test set-up: the Triton interpreter on machines without a GPU, the ``gpu`` and ``interpret`` markers, and the
``device`` fixture of the tests that run both ways.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` decorator runs, so it is set here, before
kda_ops is imported, whenever no CUDA device is present.

A test that takes ``device`` runs twice: on ``"cpu"`` (marked ``interpret``: the Triton kernels under the
interpreter, skipped where a GPU is present, since the interpreter is process-wide) and on ``"cuda"`` (marked
``gpu``: the compiled kernels, skipped without a GPU). ``pytest -m gpu`` on the GPU machine picks the second.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kda_ops.common import TRITON_MIN, triton_usable  # noqa: E402 - after the interpreter's switch

# a triton the kernels support (an older one, as torch 2.6 pins, counts as none: the kernels refuse it)
HAS_TRITON = triton_usable()

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpret, id="cpu"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the H200)")
    config.addinivalue_line("markers", "interpret: runs Triton kernels under TRITON_INTERPRET=1 on the CPU")
    config.addinivalue_line("markers", "triton: needs triton itself (every test under tests/triton, given here, and "
                            "the benchmark scripts'), whether or not it runs a kernel")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_triton = pytest.mark.skip(reason=f"needs triton >= {'.'.join(map(str, TRITON_MIN))}")
    kernels = os.path.join(os.path.dirname(__file__), "triton") + os.sep
    for item in items:
        if str(item.path).startswith(kernels):
            item.add_marker(pytest.mark.triton)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpret" in item.keywords and (HAS_CUDA or not HAS_TRITON):
            item.add_marker(skip_triton if not HAS_TRITON else pytest.mark.skip(reason="interpreter tests run on CPU"))


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """``cpu`` (the interpreter) or ``cuda`` (compiled): the device a stage test runs its kernels on."""
    return torch.device(request.param)


@pytest.fixture
def checked() -> Iterator[None]:
    """The checked mode on (``kda_ops.set_checks``) for one test."""
    import kda_ops

    kda_ops.set_checks(True)
    try:
        yield
    finally:
        kda_ops.set_checks(False)
