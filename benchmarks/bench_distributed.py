"""Context parallelism timed: ``kda_ops.distributed.chunk_kda`` on one rank against the plain call, and its strong
and weak scaling over the ranks of a ``torchrun`` job.

- ``python benchmarks/bench_distributed.py [--T 32768] [--H 32] [--out FILE]``: one process, a one-rank NCCL group.
  The context-parallel path computes what ``kda_ops.chunk_kda`` does plus the slice's affine state map (``K`` more
  value columns from the identity), the all-gather of the summaries and their fold; on one rank that is its whole
  overhead. Rows: the forward (no grad) and forward + backward (random ``do``), GPU ms (``do_bench`` median, L2
  flushed), peak memory above the inputs, and each time over ``chunk_kda``'s (the ratios).
- ``torchrun --standalone --nproc-per-node W benchmarks/bench_distributed.py --scaling strong|weak --rows DIR``: W
  ranks, one GPU each (NCCL). ``strong``: one sequence of ``--T`` tokens (default 262144) split W ways; ``weak``:
  ``--T`` tokens per rank (default 65536). Each rank's slice is timed forward and forward + backward (CUDA events
  over ``--reps`` calls between barriers; the slowest rank's median), and the all-gather of the summaries alone;
  the largest rank's peak memory above its inputs and their gradients. With ``--check`` the ranks' outputs, final
  states and gradients are compared with ``chunk_kda`` on the whole sequence in one process (rank 0), on a sequence
  of ``--check-T`` tokens (default 32768, split W ways), in bf16 and float32, and in bf16 both calls' errors against
  float64. Rank 0 writes the run's row as ``DIR/<mode>-<W>.json``.
- ``python benchmarks/bench_distributed.py --tables DIR [--out FILE]``: the rows in ``DIR`` as the strong and weak
  scaling tables (and ``DIR/bench_distributed.png``).

Inputs: bf16 q, k, v, beta, g = logsigmoid(randn) in fp32, K = V = ``--D`` (128), l2norm in kernel, final state out;
each rank's slice drawn from a generator seeded by its rank. ``--device cpu`` runs the scaling mode over gloo on
the CPU (wall-clock times, small shapes): a check that the script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

# the options of every call timed here
OPTS: dict[str, Any] = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)


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


def overhead(args: argparse.Namespace) -> None:
    """The one-rank mode: the context-parallel path against ``chunk_kda`` in one process."""
    args.T = args.T or 32768
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
        import bench_chunk  # it imports triton, which the scaling mode on the CPU does without

        x = bench_chunk.inputs(1, args.T, args.H)
        calls: dict[str, Callable[..., Any]] = {"chunk_kda": kda_ops.chunk_kda,
                                                "distributed.chunk_kda, 1 rank": distributed.chunk_kda}
        xg = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        do = torch.randn_like(x["v"])
        rows = []
        outs = {}
        for name, fn in calls.items():
            with torch.no_grad():
                outs[name] = fn(**x, **OPTS)
                f_ms, f_gb = timed(lambda fn=fn: fn(**x, **OPTS))

            def step(fn: Callable[..., Any] = fn) -> None:
                o, _ = fn(**xg, **OPTS)
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


def slice_inputs(T: int, H: int, D: int, seed: int, device: torch.device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:  # fmt: skip
    """One slice of the benchmark's row: ``T`` tokens drawn from a generator seeded by ``seed`` (the rank)."""
    gen = torch.Generator(device=device).manual_seed(1000 + seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    return {"q": rnd(1, T, H, D).to(dtype), "k": rnd(1, T, H, D).to(dtype), "v": rnd(1, T, H, D).to(dtype),
            "g": torch.nn.functional.logsigmoid(rnd(1, T, H, D)),
            "beta": torch.rand(1, T, H, generator=gen, device=device).to(dtype)}  # fmt: skip


def rank_ms(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """This rank's median ms of ``fn`` over ``reps`` calls, each between barriers (so that every call waits for the
    slowest rank's previous one), after two warm-up calls."""
    import torch.distributed as dist

    times = []
    for i in range(reps + 2):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 2:
            times.append(ms)
    return statistics.median(times)


def slowest(x: float, device: torch.device) -> float:
    """The largest ``x`` over the ranks."""
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def check(T: int, H: int, D: int, device: torch.device) -> dict[str, float]:
    """The distributed call against ``chunk_kda`` on the whole row in one process (rank 0), at ``T`` tokens split
    evenly: the largest relative difference over ``o``, the final state and every gradient, in bf16 and float32 (on
    the CPU float64 and float32), and in bf16 both calls' largest relative error against float64."""
    import torch.distributed as dist

    import kda_ops
    from kda_ops import distributed

    world, rank = dist.get_world_size(), dist.get_rank()
    local = T // world
    out: dict[str, float] = {}
    low = torch.bfloat16 if device.type == "cuda" else torch.float64
    for label, dtype in ((str(low).split(".")[-1], low), ("float32", torch.float32)):
        parts = [slice_inputs(local, H, D, r, device, dtype) for r in range(world)]
        x = {n: t.detach().clone().requires_grad_(True) for n, t in parts[rank].items()}
        o, s = distributed.chunk_kda(**x, **OPTS)
        assert s is not None
        gen = torch.Generator(device=device).manual_seed(7)
        dos = [torch.randn(1, local, H, D, generator=gen, device=device).to(dtype) for _ in range(world)]
        dst = torch.randn(1, H, D, D, generator=gen, device=device)
        # the final state is every rank's: its cotangent enters once, on rank 0 (every rank runs one backward)
        ((o * dos[rank]).sum() + (s * (dst if rank == 0 else torch.zeros_like(dst))).sum()).backward()
        mine = [o.detach(), s.detach(), *(x[n].grad for n in ("q", "k", "v", "g", "beta"))]
        gathered = [[torch.empty_like(m) for _ in range(world)] for m in mine]
        for g_list, m in zip(gathered, mine):
            assert m is not None
            dist.all_gather(g_list, m.contiguous())
        if rank == 0:
            whole = {n: torch.cat([p[n] for p in parts], 1) for n in parts[0]}
            ref_dtypes = (dtype,) if dtype != torch.bfloat16 else (dtype, torch.float64)
            results = {}
            for rd in ref_dtypes:
                # the same dtypes as the distributed call's, or every input in float64 for the oracle
                xr = {n: (t if rd == dtype else t.double()).detach().requires_grad_(True) for n, t in whole.items()}
                orr, sr = kda_ops.chunk_kda(**xr, **OPTS)
                assert sr is not None
                ((orr * torch.cat(dos, 1).to(orr.dtype)).sum() + (sr * dst.to(sr.dtype)).sum()).backward()
                results[rd] = [orr.detach(), sr.detach(), *(xr[n].grad for n in ("q", "k", "v", "g", "beta"))]
            # every rank's final state against the one reference
            dist_all = [torch.cat(gathered[0], 1), torch.stack(gathered[1]),
                        *(torch.cat(g_list, 1) for g_list in gathered[2:])]  # fmt: skip
            for res in results.values():
                res[1] = res[1].expand(world, *res[1].shape)

            def rel(a: list[Any], b: list[Any]) -> float:
                return max(float((u.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30))
                           for u, w in zip(a, b))  # fmt: skip

            out[f"{label} vs one process"] = rel(dist_all, results[dtype])
            if torch.float64 in results and dtype == torch.bfloat16:
                out["bf16 error, distributed"] = rel(dist_all, results[torch.float64])
                out["bf16 error, one process"] = rel(results[dtype], results[torch.float64])
    return out


def scaling(args: argparse.Namespace) -> None:
    """The torchrun mode: this rank's slice timed (forward, forward + backward, the all-gather alone)."""
    import torch.distributed as dist

    from kda_ops import distributed

    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        local = args.T // world if args.scaling == "strong" else args.T
        total = local * world
        dtype = torch.bfloat16 if cuda else torch.float32
        x = slice_inputs(local, args.H, args.D, rank, device, dtype)
        xg = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        do = torch.randn_like(x["v"])

        def forward() -> None:
            with torch.no_grad():
                distributed.chunk_kda(**x, **OPTS)

        def step() -> None:
            for t in xg.values():
                t.grad = None
            o, _ = distributed.chunk_kda(**xg, **OPTS)
            o.backward(do)

        summary = torch.zeros(1, args.H, args.D, 2 * args.D, dtype=torch.float32, device=device)
        if cuda:  # the peak above the inputs and their gradients (one step first, as the one-rank mode's)
            step()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        row: dict[str, Any] = {"mode": args.scaling, "ranks": world, "T": total, "T_rank": local, "H": args.H,
                               "D": args.D, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                               "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                               "forward_ms": slowest(rank_ms(forward, args.reps, device), device),
                               "fwd_bwd_ms": slowest(rank_ms(step, args.reps, device), device),
                               "gather_ms": slowest(rank_ms(lambda: distributed._gather(summary, dist.group.WORLD),
                                                            args.reps, device), device)}  # fmt: skip
        if cuda:
            row["peak_gb"] = slowest((torch.cuda.max_memory_allocated(device) - base) / 1e9, device)
        if args.check:
            row["check"] = check(min(args.check_T, total), args.H, args.D, device)
        if rank == 0:
            print(json.dumps(row), flush=True)
            if args.rows:
                args.rows.mkdir(parents=True, exist_ok=True)
                (args.rows / f"{args.scaling}-{world}.json").write_text(json.dumps(row, indent=1) + "\n")
        dist.barrier()  # no rank leaves while rank 0 still checks or writes (gloo aborts a rank that exits early)
    finally:
        dist.destroy_process_group()


def tables(args: argparse.Namespace) -> None:
    """The rows written by the torchrun mode, as the strong and weak scaling tables and a plot."""
    rows = [json.loads(f.read_text()) for f in sorted(args.tables.glob("*.json"))]
    lines: list[str] = []
    for mode in ("strong", "weak"):
        sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["ranks"])
        if not sel:
            continue
        same = "T" if mode == "strong" else "T_rank"
        for key in (same, "H", "D", "device"):
            if len({r[key] for r in sel}) > 1:
                sys.exit(f"bench_distributed: the {mode} rows in {args.tables} differ in {key}: one run per rank count")
        one = next((r for r in sel if r["ranks"] == 1), None)
        lines += [f"## {mode.capitalize()} scaling", "",
                  f"{sel[0]['device']}, torch {sel[0]['torch']}, {sel[0]['date']}; B1 H{sel[0]['H']} K = V = "
                  f"{sel[0]['D']}; the slowest rank's median ms; speed-up against one rank"
                  + (" (time of one rank over time of W ranks" + (", times W" if mode == "weak" else "") + ")"
                     if one else "") + ".", "",
                  "| ranks | T | T per rank | forward ms | fwd + bwd ms | all-gather ms | peak GB (largest rank) | "
                  "forward speed-up | fwd + bwd speed-up |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in sel:
            k = r["ranks"] if mode == "weak" else 1
            sp = ((f"{k * one['forward_ms'] / r['forward_ms']:.2f}", f"{k * one['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}")
                  if one else ("-", "-"))  # fmt: skip
            peak = f"{r['peak_gb']:.2f}" if "peak_gb" in r else "-"
            lines.append(f"| {r['ranks']} | {r['T']} | {r['T_rank']} | {r['forward_ms']:.3f} | {r['fwd_bwd_ms']:.3f}"
                         f" | {r['gather_ms']:.3f} | {peak} | {sp[0]} | {sp[1]} |")  # fmt: skip
        checks = [(r["ranks"], r["check"]) for r in sel if "check" in r]
        if checks:
            lines += ["", "Checks (largest relative difference or error):", ""]
            lines += [f"- {w} ranks: " + ", ".join(f"{k} {v:.2e}" for k, v in c.items()) for w, c in checks]
        lines.append("")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, mode in zip(axes, ("strong", "weak")):
            sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["ranks"])
            if sel:
                ws = [r["ranks"] for r in sel]
                ax.plot(ws, [r["forward_ms"] for r in sel], "o-", label="forward")
                ax.plot(ws, [r["fwd_bwd_ms"] for r in sel], "s-", label="forward + backward")
                ax.plot(ws, [r["gather_ms"] for r in sel], "^:", label="all-gather alone")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("ranks")
                ax.set_ylabel("ms (slowest rank)")
                ax.set_title(f"{mode} scaling, T = {sel[-1]['T'] if mode == 'strong' else sel[0]['T_rank']}"
                             + (" per rank" if mode == "weak" else ""))  # fmt: skip
                ax.grid(True, which="both", alpha=0.3)
                ax.legend()
        fig.tight_layout()
        fig.savefig(args.tables / "bench_distributed.png", dpi=130)
        plt.close(fig)
    except ImportError:
        pass
    _bench.emit(lines, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    parser.add_argument("--skip-fla", action="store_true", help="accepted for symmetry: no peer is timed here")
    parser.add_argument("--T", type=int, default=None,
                        help="tokens: 32768 (one rank), 262144 (strong scaling), 65536 per rank (weak scaling)")
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--D", type=int, default=128, help="K = V (the scaling modes)")
    parser.add_argument("--scaling", choices=("strong", "weak"), help="the torchrun mode")
    parser.add_argument("--rows", type=Path, help="the torchrun mode: write the row (JSON) into this directory")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement (the torchrun mode)")
    parser.add_argument("--check", action="store_true", help="compare with one process (the torchrun mode)")
    parser.add_argument("--check-T", type=int, default=32768)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tables", type=Path, help="print the tables of the rows in this directory")
    args = parser.parse_args()
    if args.tables:
        tables(args)
    elif args.scaling:
        if args.T is None:
            args.T = 262144 if args.scaling == "strong" else 65536
        scaling(args)
    else:
        overhead(args)


if __name__ == "__main__":
    main()
