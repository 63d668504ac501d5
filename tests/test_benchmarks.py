"""The benchmark scripts on a machine without a GPU: each prints its help, and each GPU benchmark takes the common
flags and ends with "needs a CUDA GPU" before any CUDA call, not with a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the benchmark scripts time Triton kernels")
pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
GPU_SCRIPTS = [name for name in SCRIPTS if name.startswith("bench_")]


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_scripts_are_found() -> None:
    assert {"bench_chunk.py", "bench_chunk_bwd.py", "bench_recurrent.py", "bench_prefill.py"} <= set(GPU_SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_and_cites_no_issue_number(script: str) -> None:
    run = _run(script, "--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert not re.search(r"\bissues? #?\d", run.stdout, re.I), run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_without_a_gpu_the_script_says_so(script: str) -> None:
    run = _run(script, "--skip-fla")
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_launch_variants_parse_and_restore_the_table() -> None:
    """``bench_launch.py``'s variants: parsed per stage, applied for their block only, bad ones named."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_launch

    from kda_ops.triton import launch

    before = {stage: dict(entry) for stage, entry in launch.LAUNCH.items()}
    variant = bench_launch.parse_variant("prepare:BK=16,maxnreg=168+dqk:num_warps=4")
    assert variant == {"prepare": {"BK": 16, "maxnreg": 168}, "dqk": {"num_warps": 4}}
    with bench_launch.launched(variant):
        assert launch.launch("prepare", BK=128, BV=128)["BK"] == 16
        assert launch.launch("prepare", BK=128, BV=128)["maxnreg"] == 168
    assert launch.LAUNCH == before
    flags = bench_launch.parse_variant("dqk:PREFETCH=2,HOLD_DM=1+dv:LATE_STORE=1")
    with bench_launch.launched(flags):  # a stage's schedule flags reach its kernel's launch
        assert launch.launch("dqk", BK=128, BV=128)["PREFETCH"] == 2
        assert launch.launch("dv", BK=128, BV=128)["LATE_STORE"] == 1
    assert launch.launch("dqk", BK=128, BV=128).get("PREFETCH") == before["dqk"].get("PREFETCH")
    assert "LATE_STORE" not in launch.launch("dv", BK=128, BV=128)
    forms = bench_launch.parse_variant("forms:scan_segments=4,output_per_item=1")
    with bench_launch.launched(forms):
        assert (launch.forced.scan_segments, launch.forced.output_per_item) == (4, True)
    assert (launch.forced.scan_segments, launch.forced.output_per_item) == (None, None)
    for bad in ("prepare", "nostage:BK=16", "prepare:BK=x", "prepare:XX=1", "forms:BK=16", "prepare:PREFETCH=1"):
        with pytest.raises(ValueError, match="variant"):
            bench_launch.parse_variant(bad)
    assert bench_launch.parse_shape("1,32768,32") == (1, 32768, 32)
    with pytest.raises(ValueError, match="--shapes"):
        bench_launch.parse_shape("1,32768")


def test_launch_variants_after_the_shapes_are_variants() -> None:
    """``bench_launch.py --shapes 1,1024,32 forms:scan_segments=4``: the variant after the shapes is a variant."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_launch

    got = bench_launch.sort_arguments(["prepare:BK=16"], ["1,1024,32", "forms:scan_segments=4", "8,4096,32"])
    assert got == (["prepare:BK=16", "forms:scan_segments=4"], ["1,1024,32", "8,4096,32"])
