"""``tests/triton/sm90.py``'s arguments: sources, and ``NAME=VALUE`` overrides of every variant's launch (a launch or
kernel form probed for sm_90 without a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton.sm90 import ROOT, split_arguments, with_overrides


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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.triton.sm90", "chunk.l2norm", "BK=sixty"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert run.returncode == 1
    assert "'BK=sixty'" in json.loads(run.stdout.splitlines()[0])["error"]


def test_the_override_reaches_the_build() -> None:
    triton = pytest.importorskip("triton", minversion="3.6")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.triton.sm90", "chunk.l2norm", "num_warps=2"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)  # fmt: skip
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, run.stderr[-3000:]
    assert records and all(r["ok"] and r["num_warps"] == 2 for r in records)


def test_an_override_of_no_parameter_fails_the_run() -> None:
    triton = pytest.importorskip("triton", minversion="3.6")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.triton.sm90", "chunk.l2norm", "BKK=64"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert run.returncode == 1
    assert "['BKK']" in json.loads(run.stdout.splitlines()[-1])["error"]
