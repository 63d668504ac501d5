"""Chunkwise KDA forward + backward benchmark: kda_ops against fla-core's ``chunk_kda`` and causal SDPA.

Same call on both KDA sides (``bench_chunk.py``'s inputs): q, k, v bf16 ``[B, T, H, 128]`` with
``use_qk_l2norm_in_kernel=True``, g = logsigmoid(randn) fp32, beta bf16 in [0, 1], ``output_final_state=True``;
the backward with a random ``do`` (bf16) and ``dht`` (fp32). SDPA (causal) forward + backward on the same q, k, v
as ``[B, H, T, 128]``. Shapes: (B, T, H) in {(1, 32768, 32), (8, 4096, 32), (2, 16384, 16), (1, 32768, 8),
(1, 32768, 4)}; with ``--bh-sweep`` also B1 T32768 at 1 to 64 heads (plotted as ``bench_chunk_bwd_bh.png``), with
``--graph`` as CUDA-graph replays of the whole step (at one or two heads an eager step's launches take the host
longer than its kernels take the GPU).

Columns: GPU ms of forward + backward (``triton.testing.do_bench`` median after a compiling, autotuning call),
peak memory above the inputs (``torch.cuda.max_memory_allocated`` minus what was allocated before the call, reset
before each), ours / fla. Accuracy at T = 1000: relative error of every bf16 gradient of ours and of fla against
the float64 oracle (``kda_ops.reference.chunk_bwd`` on float64 copies of the same inputs).

Usage: ``python benchmarks/bench_chunk_bwd.py [--out DIR] [--wheels W ...] [--shapes N] [--skip-fla] [--profile]
[--bh-sweep] [--graph]``
(``--profile``: our kernels' GPU time at the first shape); writes ``bench_chunk_bwd.md``,
``.json`` and ``.png`` to ``--out`` (default ``benchmarks/results``); the markdown table is printed last.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402
from bench_chunk import BH_SWEEP_H, BH_SWEEP_T, DEV, ROOT, SHAPES, inputs, load_fla, plot  # noqa: E402

import kda_ops  # noqa: E402
from kda_ops import reference  # noqa: E402
from kda_ops.common import Options  # noqa: E402
from kda_ops.testing import rel_err  # noqa: E402

GRADS = ("q", "k", "v", "g", "beta")


def fwd_bwd(
    fn: Callable[..., Any], x: dict[str, torch.Tensor], do: torch.Tensor, dht: torch.Tensor
) -> Callable[[], Any]:
    """A closure running ``fn``'s forward and backward on leaf copies of ``x``; returns the gradients."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}

    def run() -> list[torch.Tensor | None]:
        for t in leaves.values():
            t.grad = None
        o, s = fn(**leaves, use_qk_l2norm_in_kernel=True, output_final_state=True)
        torch.autograd.backward([o, s], [do, dht])
        return [leaves[n].grad for n in GRADS]

    return run


def sdpa_run(x: dict[str, torch.Tensor], do: torch.Tensor) -> Callable[[], Any]:
    q, k, v = (x[n].transpose(1, 2).detach().clone().requires_grad_() for n in ("q", "k", "v"))
    dO = do.transpose(1, 2)

    def run() -> None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(dO)

    return run


def timed(run: Callable[[], Any], graph: bool = False) -> tuple[float, float]:
    """(ms, peak GB above what was allocated before the call); with ``graph`` the ms of a CUDA-graph replay of
    ``run``, captured once after its compiling, autotuning call."""
    run()  # compile and autotune
    torch.cuda.synchronize()
    fn = _bench.capture(run)[0].replay if graph else run
    ms = float(do_bench(fn, warmup=10, rep=100, return_mode="median"))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 1e9


def kernel_profile(run: Callable[[], Any], reps: int = 3) -> list[str]:
    """GPU ms per call of each kernel ``run`` launches (torch.profiler), as markdown rows, slowest first."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    lines = ["| kernel | launches | ms |", "|---|---|---|"]
    for e in sorted(events, key=lambda e: -e.device_time_total):
        lines.append(f"| `{e.key[:80]}` | {e.count // reps} | {e.device_time_total / reps / 1000:.3f} |")
    return lines


def grad_errors(fn: Callable[..., Any], x: dict[str, torch.Tensor], do: torch.Tensor, dht: torch.Tensor,
                ref: tuple[Any, ...]) -> dict[str, float]:  # fmt: skip
    got = fwd_bwd(fn, x, do, dht)()
    return {"d" + n: rel_err(a, r) for n, a, r in zip(GRADS, got, ref) if a is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--wheels", nargs="*", default=sorted(glob.glob(str(ROOT / ".whl" / "*.whl"))))
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="time only the first N shapes")
    ap.add_argument("--only", type=int, nargs="*", default=None,
                    help="time only these shape indices (fla autotunes minutes per shape)")  # fmt: skip
    ap.add_argument("--skip-fla", action="store_true",
                    help="leave fla out (its first call at a new shape autotunes for minutes)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="also list our kernels' GPU time at the first shape")
    ap.add_argument("--bh-sweep", action="store_true",
                    help=f"also time B1 T{BH_SWEEP_T} at H in {BH_SWEEP_H} (bench_chunk.py's B·H sweep)")  # fmt: skip
    ap.add_argument("--graph", action="store_true",
                    help="time the B·H sweep as CUDA-graph replays (the host's launches drop out)")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_chunk_bwd: needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fla_fn, fla_src = (None, "fla skipped") if args.skip_fla else load_fla(args.wheels)
    rows: list[dict[str, Any]] = []
    main_shapes = SHAPES[: args.shapes] if args.only is None else [SHAPES[i] for i in args.only]
    swept = [(1, BH_SWEEP_T, H) for H in BH_SWEEP_H] if args.bh_sweep else []
    # (shape, timed as a CUDA-graph replay): the main shapes eager; the sweep's as --graph says, a shape of both
    # timed once more only where the two timings differ
    picked = [(shape, False) for shape in main_shapes]
    picked += [(shape, args.graph) for shape in swept if args.graph or shape not in main_shapes]
    for (B, T, H), graph in picked:
        print(f"timing B{B} T{T} H{H}" + (" (graph)" if graph else ""), file=sys.stderr, flush=True)
        x = inputs(B, T, H)
        gen = torch.Generator(device=DEV).manual_seed(9)
        do = torch.randn(x["v"].shape, generator=gen, device=DEV).bfloat16()
        dht = torch.randn(B, H, 128, 128, generator=gen, device=DEV)
        r: dict[str, Any] = {"B": B, "T": T, "H": H, "graph": graph}
        r["ours_ms"], r["ours_gb"] = timed(fwd_bwd(kda_ops.chunk_kda, x, do, dht), graph)
        print(f"  ours {r['ours_ms']:.3f} ms, {r['ours_gb']:.2f} GB", file=sys.stderr, flush=True)
        r["fla_ms"], r["fla_gb"] = None, None
        if fla_fn:
            try:
                r["fla_ms"], r["fla_gb"] = timed(fwd_bwd(fla_fn, x, do, dht), graph)
            except Exception as e:  # noqa: BLE001 - a peer failure (its capture, say) is reported, not fatal
                print(f"  fla failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        r["sdpa_ms"], r["sdpa_gb"] = timed(sdpa_run(x, do), graph)
        rows.append(r)
        print(f"  {r}", file=sys.stderr, flush=True)
        del x, do, dht
        torch.cuda.empty_cache()
    # accuracy at T = 1000 against the float64 analytic backward
    x = inputs(1, 1000, 32)
    gen = torch.Generator(device=DEV).manual_seed(9)
    do = torch.randn(x["v"].shape, generator=gen, device=DEV).bfloat16()
    dht = torch.randn(1, 32, 128, 128, generator=gen, device=DEV)
    ref = reference.chunk_bwd(do.double(), dht.double(), *(x[n].double() for n in GRADS), 128**-0.5, None, None,
                              None, None, Options(use_qk_l2norm=True))  # fmt: skip
    errs = {"ours": grad_errors(kda_ops.chunk_kda, x, do, dht, ref)}
    if fla_fn:
        errs["fla"] = grad_errors(fla_fn, x, do, dht, ref)
    lines = [f"Forward + backward, bf16, K = V = 128 ({fla_src}; {torch.cuda.get_device_name()})", "",
             "| B | T | H | timed | ours ms | fla ms | SDPA ms | ours / fla | ours GB | fla GB | SDPA GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def f(v: float | None, p: int = 2) -> str:
        return "-" if v is None else f"{v:.{p}f}"

    for r in rows:
        ratio = r["ours_ms"] / r["fla_ms"] if r["fla_ms"] else None
        timed_as = "graph" if r["graph"] else "eager"
        cells = [r["B"], r["T"], r["H"], timed_as, f(r["ours_ms"]), f(r["fla_ms"]), f(r["sdpa_ms"]), f(ratio),
                 f(r["ours_gb"]), f(r["fla_gb"]), f(r["sdpa_gb"])]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "Gradient error vs float64 oracle, B1 T1000 H32 bf16:", "",
              "| impl | " + " | ".join("d" + n for n in GRADS) + " |", "|---" * (len(GRADS) + 1) + "|"]  # fmt: skip
    for name, e in errs.items():
        lines.append(f"| {name} | " + " | ".join(f"{e.get('d' + n, float('nan')):.2e}" for n in GRADS) + " |")
    if args.profile:
        B, T, H = SHAPES[0]
        x = inputs(B, T, H)
        gen = torch.Generator(device=DEV).manual_seed(9)
        do = torch.randn(x["v"].shape, generator=gen, device=DEV).bfloat16()
        dht = torch.randn(B, H, 128, 128, generator=gen, device=DEV)
        lines += ["", f"Our kernels, forward + backward at B{B} T{T} H{H} (torch.profiler, GPU ms per call):", ""]
        lines += kernel_profile(fwd_bwd(kda_ops.chunk_kda, x, do, dht))
    md = "\n".join(lines)
    (out / "bench_chunk_bwd.md").write_text(md + "\n")
    (out / "bench_chunk_bwd.json").write_text(json.dumps({"rows": rows, "errors": errs, "fla": fla_src}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"B{r['B']} T{r['T']} H{r['H']}" for r in rows]
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(len(rows))
        for i, (key, name) in enumerate((("ours_ms", "kda_ops"), ("fla_ms", "fla-core 0.6.0"), ("sdpa_ms", "SDPA"))):
            ax.bar([j + 0.27 * i for j in xs], [r[key] or 0 for r in rows], width=0.27, label=name)
        ax.set_xticks([j + 0.27 for j in xs], labels)
        ax.set_ylabel("forward + backward, ms")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "bench_chunk_bwd.png", dpi=120)
        plt.close(fig)
        bh = sorted((r for r in rows if (r["B"], r["T"], r["H"]) in swept and r["graph"] == args.graph),
                    key=lambda r: r["H"])  # fmt: skip
        if bh:
            plot(bh, out / "bench_chunk_bwd_bh.png", f"Chunkwise KDA forward + backward by heads, "
                 f"{torch.cuda.get_device_name()}", x="H", ylabel="forward + backward, ms (median)")  # fmt: skip
    except ImportError:
        print("matplotlib missing: no plot")
    print(md)


if __name__ == "__main__":
    main()
