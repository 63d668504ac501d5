"""The context-parallel path on one rank against the plain chunk call: the cost of its summaries.

``kda_ops.distributed.chunk_kda`` on a one-rank NCCL group computes what ``kda_ops.chunk_kda`` does plus the slice's
affine state map (``K`` more value columns from the identity), the all-gather of the summaries and their fold; on
one rank that is its whole overhead. Inputs are ``bench_chunk.py``'s (bf16, K = V = 128, l2norm in kernel, final
state out), B1 T32768 H32 by default. Rows: the forward (no grad) and forward + backward (random ``do``), GPU ms
(``do_bench`` median, L2 flushed), peak memory above the inputs, and each time over ``chunk_kda``'s (the ratios).

Usage: ``python benchmarks/bench_distributed.py [--out FILE] [--T 32768] [--H 32]``; the markdown table is printed
last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402
import bench_chunk  # noqa: E402


def timed(fn: Callable[[], Any], grads: list[torch.Tensor] | None = None) -> tuple[float, float]:
    """GPU ms (do_bench median; ``grads`` reset to None before each repetition) and peak GB above what was
    allocated before."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9
    return float(do_bench(fn, warmup=5, rep=200, grad_to_none=grads, return_mode="median")), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    parser.add_argument("--skip-fla", action="store_true", help="accepted for symmetry: no peer is timed here")
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--H", type=int, default=32)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_distributed: needs a CUDA GPU")
    import torch.distributed as dist
    import triton

    import kda_ops
    from kda_ops import distributed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        x = bench_chunk.inputs(1, args.T, args.H)
        opts = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
        calls: dict[str, Callable[..., Any]] = {"chunk_kda": kda_ops.chunk_kda,
                                                "distributed.chunk_kda, 1 rank": distributed.chunk_kda}
        xg = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        do = torch.randn_like(x["v"])
        rows = []
        outs = {}
        for name, fn in calls.items():
            with torch.no_grad():
                outs[name] = fn(**x, **opts)
                f_ms, f_gb = timed(lambda fn=fn: fn(**x, **opts))

            def step(fn: Callable[..., Any] = fn) -> None:
                o, _ = fn(**xg, **opts)
                o.backward(do)

            b_ms, b_gb = timed(step, list(xg.values()))
            rows.append((name, f_ms, f_gb, b_ms, b_gb))
            print(rows[-1], file=sys.stderr, flush=True)
        (o1, s1), (o2, s2) = outs.values()
        diff_o = float((o1.float() - o2.float()).abs().max())
        diff_s = float((s1 - s2).abs().max())
    finally:
        dist.destroy_process_group()
    base = rows[0]
    table = [
        f"# Context-parallel path on one rank, {datetime.date.today().isoformat()}",
        "",
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}. "
        f"B1 T{args.T} H{args.H} K = V = 128 bf16, l2norm in kernel, final state out. GB: peak above the inputs.",
        "",
        "| call | forward ms | forward GB | fwd + bwd ms | fwd + bwd GB | forward ratio | fwd + bwd ratio |",
        "|---|---|---|---|---|---|---|",
        *(f"| {n} | {f:.3f} | {fg:.2f} | {b:.3f} | {bg:.2f} | {f / base[1]:.2f} | {b / base[3]:.2f} |"
          for n, f, fg, b, bg in rows),
        "",
        f"Largest difference of the two calls' outputs: o {diff_o:.2e}, final state {diff_s:.2e}.",
    ]  # fmt: skip
    _bench.emit(table, args.out)


if __name__ == "__main__":
    main()
