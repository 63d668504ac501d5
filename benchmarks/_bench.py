"""What the benchmark scripts share: the peer's import from carried wheels, and host timing."""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _import_fla(name: str) -> tuple[Callable[..., Any], str]:
    fla = importlib.import_module("fla")
    fn: Callable[..., Any] = getattr(importlib.import_module("fla.ops.kda"), name)
    return fn, str(getattr(fla, "__version__", "?"))


def load_fla(wheels: list[str], name: str) -> tuple[Callable[..., Any] | None, str]:
    """``fla.ops.kda.<name>`` and where it came from (or why it is missing): from the environment, else from
    ``wheels`` (fla-core and its dependencies) unpacked into a temporary folder."""
    try:
        fn, version = _import_fla(name)
        return fn, f"fla {version} (installed)"
    except Exception as e:  # noqa: BLE001 - any import failure means "not in this environment"
        reason = f"{type(e).__name__}: {e}"
    if not wheels:
        return None, f"fla not importable ({reason}) and no wheels given"
    site = tempfile.mkdtemp(prefix="bench-wheels-")
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    sys.path.insert(0, site)
    for mod in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[mod]
    try:
        fn, version = _import_fla(name)
        return fn, f"fla {version} (from {', '.join(os.path.basename(w) for w in wheels)})"
    except Exception as e:  # noqa: BLE001
        return None, f"fla not importable: {type(e).__name__}: {e}"


def host_us(fn: Callable[[], Any], iters: int = 500, rounds: int = 5) -> float:
    """Host µs per call of back-to-back calls, synchronised at the ends of each round only: the best of ``rounds``
    rounds of ``iters // rounds`` calls (the H200 machine's host timings of one round varied by ±20 µs on
    2026-11-29; the best round is the cost without the interference)."""
    for _ in range(20):
        fn()
    n = max(1, iters // rounds)
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` captured once in a CUDA graph (after three warm-up calls on a side stream) and the output it wrote."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # the capture on a stream of its own inside a stream context: a capture that fails (a peer's call that cannot be
    # captured) then still leaves the caller on its own stream
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph, out


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s: (read + written) / do_bench median time of a 1 GiB copy."""
    from triton.testing import do_bench

    src = torch.empty(2**28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = float(do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median"))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def cold_us(fn: Callable[[], Any], reps: int = 200, flush_bytes: int = 2**28) -> float:
    """Median GPU µs of ``fn`` with the L2 cache evicted before each repetition by *reading* a buffer larger than it.

    ``triton.testing.do_bench`` evicts by writing (zeroing) a 256 MB buffer: the L2 is then full of dirty lines,
    and the timed kernel pays for writing them back, a tax of up to the L2's size (50 MB on an H200) in extra DRAM
    writes, ~20 % of a decode step at B = 64. A read leaves clean lines, which are evicted for free.
    """
    buf = torch.ones(flush_bytes // 4, dtype=torch.float32, device="cuda")
    sink = torch.empty((), device="cuda")
    for _ in range(5):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        torch.sum(buf, dim=0, out=sink)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    return times[len(times) // 2] * 1e3


def emit(lines: list[str], out: Path | None) -> None:
    """The markdown ``lines`` printed (last, where a script's table goes) and, with ``out``, written there."""
    text = "\n".join(lines)
    if out:
        out.write_text(text + "\n")
    print(text)


def table_and_wheel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out FILE`` (the markdown table also written there) and ``--wheels`` (fla-core and its dependencies to
    import fla from when it is not installed; default: the repository's ``.whl/*.whl``)."""
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    parser.add_argument("--wheels", nargs="*", default=sorted(glob.glob(str(ROOT / ".whl" / "*.whl"))),
                        help="wheels to import fla from when it is not installed")  # fmt: skip


ROOT = Path(__file__).resolve().parent.parent
