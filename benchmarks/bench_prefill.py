"""Short-prefill latency: one chunkwise forward at B1 T1024 H32 K=V=128 bf16, kda_ops against fla-core.

The call of both sides: q, k, v bf16 ``[1, 1024, 32, 128]`` with the l2norm in kernel, g a precomputed fp32 log
decay ``logsigmoid(randn)``, beta bf16 in [0, 1], ``output_final_state=True`` (``bench_chunk.py``'s inputs). For a
short prompt the host's work per call dominates, so each side is measured three ways:

- eager latency: host wall time of one call followed by ``torch.cuda.synchronize()``, median of 200 (what a
  serving engine that does not capture waits for);
- GPU time: ``triton.testing.do_bench`` median of back-to-back eager calls (the kernels alone, L2 flushed);
- CUDA graph: the call captured once in a ``torch.cuda.CUDAGraph`` after warm-up (``kda_ops.warmup`` for ours),
  then the replay timed by ``do_bench`` and by wall time with a sync, as for eager; the replayed output is
  checked against an eager call.

A second table splits our eager call's host cost: back-to-back calls of each layer alone (the public function, the
op without argument checks, the Triton driver, the slot map, each stage launcher on prepared inputs), in µs per
call with a sync at the ends only.

Usage: ``python benchmarks/bench_prefill.py [--out DIR] [--T 1024] [--H 32] [--skip-fla]``; writes
``bench_prefill.md`` and prints the tables last.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

import _bench  # noqa: E402
import bench_chunk as bc  # noqa: E402

import kda_ops  # noqa: E402


def wall_ms(fn: Callable[[], Any], iters: int = 200) -> float:
    """Median host wall time of ``fn(); synchronize()`` in ms."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(name: str, fn: Callable[[], Any]) -> dict[str, Any]:
    with torch.no_grad():
        ref = fn()
        torch.cuda.synchronize()
        eager_wall = wall_ms(fn)
        eager_gpu = float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
        graph, out = _bench.capture(fn)
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
        graph_gpu = float(do_bench(graph.replay, warmup=25, rep=200, return_mode="median"))
        graph_wall = wall_ms(graph.replay)
    row = {"name": name, "eager_wall": eager_wall, "eager_gpu": eager_gpu, "graph_gpu": graph_gpu,
           "graph_wall": graph_wall, "replay_equal": same}  # fmt: skip
    print(f"  {row}", file=sys.stderr)
    return row


def host_breakdown(x: dict[str, torch.Tensor]) -> list[str]:
    """Host µs of each layer of our eager call, and of each part of it alone."""
    from kda_ops.common import Options
    from kda_ops.triton import KERNELS

    D = x["q"].shape[-1]
    op_args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, None, None, None, None, None, True,
               True, False, False, False)  # fmt: skip
    parts = {
        "kda_ops.chunk_kda (public function)": lambda: bc.call_ours(x),
        "torch.ops.kda.chunk (op, no argument checks)": lambda: torch.ops.kda.chunk(*op_args),
        "KERNELS['chunk'] (the Triton driver)": lambda: KERNELS["chunk"](
            x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, None, None, None, None, Options(True), True),
        **bc.stage_calls(x),
    }  # fmt: skip
    lines = ["| part (ours, eager) | host µs per call |", "|---|---|"]
    with torch.no_grad():
        for name, fn in parts.items():
            lines.append(f"| {name} | {_bench.host_us(fn, iters=300):.1f} |")
            print("  " + lines[-1], file=sys.stderr)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--wheels", nargs="*", default=sorted(glob.glob(str(ROOT.parent / ".whl" / "*.whl"))))
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--skip-fla", action="store_true",
                        help="leave fla out (its first call at a new shape autotunes for a long time)")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefill: needs a CUDA GPU")
    x = bc.inputs(1, args.T, args.H)
    kda_ops.warmup(**x, use_qk_l2norm_in_kernel=True, output_final_state=True)
    rows = [measure("kda_ops chunk_kda", lambda: bc.call_ours(x))]
    try:  # ours first, so that a time limit hit by the peer's autotuning leaves our figures printed
        breakdown = ["", "Host cost of our eager call, by layer:", ""] + host_breakdown(x)
    except Exception as e:  # noqa: BLE001 - the latency table stands on its own
        breakdown = ["", f"Host breakdown failed: {type(e).__name__}: {e}"]
    fla_fn, fla_note = (None, "fla skipped") if args.skip_fla else bc.load_fla(args.wheels)
    if fla_fn is not None:
        rows.append(measure("fla-core chunk_kda", lambda: bc.call_fla(fla_fn, x)))
    versions = f"torch {torch.__version__}, triton {triton.__version__}; {fla_note}"
    lines = [
        f"# Short-prefill latency, {datetime.date.today().isoformat()}",
        "",
        f"GPU: {torch.cuda.get_device_name()}; {versions}.",
        f"B = 1, T = {args.T}, H = {args.H}, K = V = 128, bf16, l2norm in kernel, final state out. ms: eager wall = "
        "host time of call + synchronize (median of 200); GPU = do_bench median; graph = one manual CUDAGraph "
        "capture, replayed.",
        "",
        "| implementation | eager wall ms | eager GPU ms | graph GPU ms | graph wall ms | replay == eager |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['name']} | {r['eager_wall']:.3f} | {r['eager_gpu']:.3f} | {r['graph_gpu']:.3f} | "
              f"{r['graph_wall']:.3f} | {r['replay_equal']} |" for r in rows]  # fmt: skip
    lines += breakdown
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_prefill.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
