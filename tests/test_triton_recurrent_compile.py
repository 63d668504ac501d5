"""The recurrent kernels compile for sm_90 (H100/H200) on a machine without a GPU, and the decode kernel does not
spill registers (``tests/_sm90_compile_recurrent.py`` in a subprocess without ``TRITON_INTERPRET``).

The interpreter tests check what the kernels compute; this checks that Triton lowers every flag combination that
matters for the GPU the project targets, so CI on a CPU catches a kernel that only the GPU machine would reject.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("_sm90_compile_recurrent.py")


def test_recurrent_kernels_compile_for_sm90_and_decode_does_not_spill() -> None:
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=1800)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert results, f"no result from {SCRIPT.name}: {run.stderr[-3000:]}"
    failed = [f"{r['variant']}: {r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert run.returncode == 0, run.stderr[-3000:]
    spills = [f"{r['variant']}: {r['stack']} bytes" for r in results if r["variant"].startswith("decode")
              and r.get("stack", 0) > 0]  # fmt: skip
    assert not spills, "the decode kernel spills: " + ", ".join(spills)
