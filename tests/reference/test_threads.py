"""The reference loops' thread policy: one intra-op thread for small steps, torch's setting for large ones, and the
setting restored afterwards (also when the body raises)."""

from __future__ import annotations

import pytest
import torch

from kda_ops.reference.threads import SMALL_STEP, loop_threads


@pytest.fixture
def two_threads() -> object:
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def test_small_steps_run_on_one_thread(two_threads: object) -> None:
    with loop_threads(16 * 64 * 64):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_large_steps_keep_the_setting(two_threads: object) -> None:
    with loop_threads(SMALL_STEP):
        assert torch.get_num_threads() == 2


def test_restored_when_the_body_raises(two_threads: object) -> None:
    with pytest.raises(RuntimeError), loop_threads(1):
        raise RuntimeError("body")
    assert torch.get_num_threads() == 2
