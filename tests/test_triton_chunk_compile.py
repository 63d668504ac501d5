"""The chunk kernels compile for sm_90 (H100/H200) on a machine without a GPU.

The interpreter tests check what the kernels compute; this checks that Triton can lower them for the GPU the
project targets (``tests/_sm90_compile.py``, in a subprocess without ``TRITON_INTERPRET``), so CI on a CPU catches
a kernel that only the GPU machine would reject. It also runs, and means the same, on a machine with a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("_sm90_compile.py")


def test_chunk_kernels_compile_for_sm90() -> None:
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=1800)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert results, f"no result from {SCRIPT.name}: {run.stderr[-3000:]}"
    failed = [f"{r['variant']}: {r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert run.returncode == 0, run.stderr[-3000:]
