"""``tests/triton/sm90.py``'s arguments: sources, and ``NAME=VALUE`` overrides of every variant's launch (a launch or
kernel form probed for sm_90 without a GPU)."""

from __future__ import annotations

import pytest

from tests.triton.sm90 import probe, split_arguments, with_overrides


def test_sources_and_overrides_split() -> None:
    sources, over = split_arguments(["chunk.dqk", "BK=64", "num_warps=4", "PREC='tf32'", "AHEAD=True"])
    assert sources == ["chunk.dqk"]
    assert over == {"BK": 64, "num_warps": 4, "PREC": "tf32", "AHEAD": True}


@pytest.mark.parametrize("arg", ["BK=sixty", "=4", "B K=4", "BK="])
def test_bad_override_names_the_argument(arg: str) -> None:
    with pytest.raises(ValueError, match=f"argument {arg!r}"):
        split_arguments(["chunk.dqk", arg])


def test_overrides_apply_to_the_kernels_own_parameters() -> None:
    over = {"BK": 64, "BV": 16, "num_warps": 4}
    args, warps, stages = with_overrides(["x", "BK"], {"x": None, "BK": 32}, 8, 1, over)
    assert args == {"x": None, "BK": 64}  # BV is not the kernel's: left out
    assert (warps, stages) == (4, 1)


def test_a_bad_override_fails_the_run() -> None:
    run, records = probe("chunk.l2norm", "BK=sixty")
    assert run.returncode == 1
    assert "'BK=sixty'" in records[0]["error"]


def test_the_override_reaches_the_build() -> None:
    run, records = probe("chunk.l2norm", "num_warps=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert records and all(r["ok"] and r["num_warps"] == 2 for r in records)


def test_an_override_of_no_parameter_fails_the_run() -> None:
    run, records = probe("chunk.l2norm", "BKK=64")
    assert run.returncode == 1
    assert "['BKK']" in records[-1]["error"]
