"""Fixtures of the recurrent kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


def _clear_launch_caches() -> None:
    from kda_ops.triton.recurrent import forward

    forward._forward_meta.cache_clear()


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Value tiles of 4: several tiles per head even at V <= 16, so the per-tile partial sums are exercised (the
    launch configuration is cached: the caches are cleared on the way in and out)."""
    from kda_ops.triton import launch

    monkeypatch.setattr(launch, "RECURRENT_BV_MAX", 4)
    _clear_launch_caches()
    yield
    monkeypatch.undo()
    _clear_launch_caches()
