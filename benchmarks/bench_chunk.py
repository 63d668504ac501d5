"""Chunkwise KDA forward benchmark: kda_ops against fla-core's ``chunk_kda`` and causal SDPA.

Same call on both KDA sides: q, k, v bf16 ``[B, T, H, 128]`` with ``use_qk_l2norm_in_kernel=True``, g a
precomputed fp32 log decay ``logsigmoid(randn)``, beta bf16 in [0, 1], ``output_final_state=True``, no initial
state. SDPA (``torch.nn.functional.scaled_dot_product_attention``, causal) runs on the same q, k, v laid out as
``[B, H, T, 128]``. Shapes: (B, T, H) in {(1, 32768, 32), (8, 4096, 32), (2, 16384, 16), (1, 32768, 8),
(1, 32768, 4)} and a sweep over T at
B * T = 32768, H = 32.

Columns: GPU ms (``triton.testing.do_bench`` median, after a warm-up call that compiles and autotunes; L2 flushed
before each repetition); TFLOP/s of the chunkwise algorithm's products at C = 64 (the same count for both KDA
implementations: ``6C²K + 4C²V + 6CKV + 2C³/3`` per chunk and head) and of causal attention for SDPA
(``2 B H T² D``); GB moved at least (inputs read once, outputs written once) and the achieved GB/s; the floor,
those bytes over the device-to-device copy bandwidth measured in the same run; and ours / fla.

Accuracy: relative error (``||out - ref|| / ||ref||``) of o and of the final state against the float64 reference
(``kda_ops.reference.chunk_fwd`` on the same bf16 inputs; it equals the naive recurrence to ~1e-15), for ours
and fla at T = 1000, and ours at T = 32768 (the oracle runs per group of 4 heads).

Options: ``--precision-sweep`` times and measures alternatives to the default per-product precision of bf16
inputs (the numbers behind ``kda_ops/triton/chunk/precision.py``); ``--sweep-bv`` times every value tile of the state
scan (``kda_ops/triton/chunk/scan.py``); ``--bh-sweep`` times B1 T32768 at 1 to 64 heads (the split scan's range
and beyond, plotted as ``bench_chunk_bh.png``), with ``--graph`` as CUDA-graph replays (at one or two heads an
eager call's launches take the host longer than its kernels take the GPU, so eager timing measures the host), and
with ``--shapes 0`` alone, without the T sweep (each shape costs fla's autotuning, ~1.5 minutes a shape on an
H200); ``--quick`` skips the T sweep and the T = 32768 error.

fla is imported from the environment, or from wheels given by ``--wheels`` (default: ``.whl/*.whl`` of the
repository: fla_core-0.6.0 and einops), unpacked into a temporary folder at run time.

Usage: ``python benchmarks/bench_chunk.py [--out DIR] [--quick] [--precision-sweep] [--sweep-bv] [--bh-sweep]
[--graph] [--shapes N]``. Writes
``bench_chunk.md``, ``bench_chunk.json`` and ``bench_chunk.png`` to ``--out`` (default ``benchmarks/results``);
the markdown table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # tests.triton.chunk.stage_kernels: the standalone stage kernels of the breakdown

import _bench  # noqa: E402

import kda_ops  # noqa: E402
from kda_ops import reference  # noqa: E402
from kda_ops.common import Options  # noqa: E402
from kda_ops.testing import rel_err  # noqa: E402

DEV = "cuda"
D = 128  # K = V
C = 64
# the last two: few heads, where the split scan (sequence parallelism inside the card) runs
SHAPES = [(1, 32768, 32), (8, 4096, 32), (2, 16384, 16), (1, 32768, 8), (1, 32768, 4)]
SWEEP_T = [512, 1024, 2048, 4096, 8192, 16384, 32768]
SWEEP_TOKENS, SWEEP_H = 32768, 32
# the B·H sweep: heads of one sequence of BH_SWEEP_T tokens, from one head (a sequence split across the card) to
# twice the main rows' heads
BH_SWEEP_H = [1, 2, 4, 8, 16, 32, 64]
BH_SWEEP_T = 32768


def load_fla(wheels: list[str]) -> tuple[Callable[..., Any] | None, str]:
    """fla's ``chunk_kda`` and where it came from (or why it is missing)."""
    return _bench.load_fla(wheels, "chunk_kda")


def inputs(B: int, T: int, H: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEV)

    return {
        "q": rnd(B, T, H, D).bfloat16(),
        "k": rnd(B, T, H, D).bfloat16(),
        "v": rnd(B, T, H, D).bfloat16(),
        "g": F.logsigmoid(rnd(B, T, H, D)),
        "beta": torch.rand(B, T, H, generator=gen, device=DEV).bfloat16(),
    }


def call_ours(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    return kda_ops.chunk_kda(**x, use_qk_l2norm_in_kernel=True, output_final_state=True)


def call_fla(fn: Callable[..., Any], x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    o, s = fn(**x, use_qk_l2norm_in_kernel=True, output_final_state=True)
    return o, s


def gpu_ms(fn: Callable[[], Any], graph: bool = False) -> float:
    """Median GPU time in ms after one compiling / autotuning call (do_bench flushes L2 each repetition). With
    ``graph`` the call is captured once in a CUDA graph and the replay is timed: where a call's launches take the
    host longer than its kernels take the GPU (a few heads), eager timing measures the host."""
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        if graph:
            g, _ = _bench.capture(fn)
            fn = g.replay
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def kda_flops(B: int, T: int, H: int) -> float:
    chunks = B * H * triton.cdiv(T, C)
    return chunks * (6 * C * C * D + 4 * C * C * D + 6 * C * D * D + 2 * C**3 / 3)


def kda_bytes(B: int, T: int, H: int) -> float:
    tok = B * T * H
    return tok * D * (2 * 3 + 4) + tok * 2 + tok * D * 2 + B * H * D * D * 4  # q k v, g, beta, o, final


def sdpa_flops(B: int, T: int, H: int) -> float:
    return 2.0 * B * H * T * T * D


def oracle(x: dict[str, torch.Tensor], heads: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 reference chunkwise forward, per group of ``heads`` heads (its pairwise decays are [.., C, C, K])."""
    H = x["q"].shape[2]
    outs, finals = [], []
    opts = Options(use_qk_l2norm=True)
    for h in range(0, H, heads):
        d = {n: t[:, :, h : h + heads].double() for n, t in x.items()}
        o, s = reference.chunk_fwd(d["q"], d["k"], d["v"], d["g"], d["beta"], D**-0.5, None, None, None, None, opts,
                                   True)  # fmt: skip
        outs.append(o)
        finals.append(s)
        del d
    return torch.cat(outs, dim=2), torch.cat(finals, dim=1)


def errors(out: tuple[torch.Tensor, Any], ref: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    return rel_err(out[0], ref[0]), rel_err(out[1], ref[1])


def error_row(name: str, T: int, fn: Callable[[], Any], ref: tuple[torch.Tensor, torch.Tensor]) -> str:
    try:
        eo, es = errors(fn(), ref)
    except Exception as e:  # noqa: BLE001 - a peer failure is reported, not fatal
        return f"| {name} | {T} | failed: {type(e).__name__} | |"
    return f"| {name} | {T} | {eo:.2e} | {es:.2e} |"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def row(B: int, T: int, H: int, fla_fn: Callable[..., Any] | None, bw: float, graph: bool = False) -> dict[str, Any]:
    x = inputs(B, T, H)
    r: dict[str, Any] = {"B": B, "T": T, "H": H}
    r["ours_ms"] = gpu_ms(lambda: call_ours(x), graph)
    r["fla_ms"] = None
    if fla_fn is not None:
        try:
            r["fla_ms"] = gpu_ms(lambda: call_fla(fla_fn, x), graph)
        except Exception as e:  # noqa: BLE001 - a peer failure is reported, not fatal
            print(f"fla failed at B={B} T={T} H={H}: {type(e).__name__}: {e}", file=sys.stderr)
    qs, ks, vs = (x[n].transpose(1, 2).contiguous() for n in ("q", "k", "v"))
    r["sdpa_ms"] = gpu_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), graph)
    r["flops"], r["bytes"] = kda_flops(B, T, H), kda_bytes(B, T, H)
    r["floor_ms"] = r["bytes"] / bw * 1e3
    r["sdpa_flops"] = sdpa_flops(B, T, H)
    print(f"  B={B} T={T} H={H}: ours {r['ours_ms']:.3f} ms, fla {fmt_ms(r['fla_ms'])} ms, "
          f"sdpa {r['sdpa_ms']:.3f} ms", file=sys.stderr)  # fmt: skip
    return r


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| B | T | H | ours ms | fla ms | ours / fla | SDPA ms | ours TFLOP/s | fla TFLOP/s | SDPA TFLOP/s "
        "| GB | ours GB/s | floor ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fla, ours = r["fla_ms"], r["ours_ms"]
        ratio = "-" if fla is None else f"{ours / fla:.2f}"
        fla_tflops = "-" if fla is None else f"{r['flops'] / fla * 1e-9:.0f}"
        lines.append(
            f"| {r['B']} | {r['T']} | {r['H']} | {ours:.3f} | {fmt_ms(fla)} | {ratio} | {r['sdpa_ms']:.3f} | "
            f"{r['flops'] / ours * 1e-9:.0f} | {fla_tflops} | {r['sdpa_flops'] / r['sdpa_ms'] * 1e-9:.0f} | "
            f"{r['bytes'] / 1e9:.2f} | {r['bytes'] / ours * 1e-6:.0f} | {r['floor_ms']:.3f} |"
        )
    return lines


def precision_sweep(fla_fn: Callable[..., Any] | None) -> list[str]:
    """Error at T = 1000 and 32768, and time at B1 T32768 H32, for each alternative precision of bf16 inputs."""
    from kda_ops.triton.chunk.precision import Precision, precision_for, use_precision

    base = precision_for(torch.bfloat16)
    variants: dict[str, Precision] = {
        "default": base,
        "intra bf16": Precision("bf16", base.solve, base.wy, base.scan, base.output, base.store),
        "wy bf16": Precision(base.intra, base.solve, "bf16", base.scan, base.output, base.store),
        "intra, wy bf16": Precision("bf16", base.solve, "bf16", base.scan, base.output, base.store),
        "solve ieee": Precision(base.intra, "ieee", base.wy, base.scan, base.output, base.store),
        "solve tf32": Precision(base.intra, "tf32", base.wy, base.scan, base.output, base.store),
        "scan tf32": Precision(base.intra, base.solve, base.wy, "tf32", base.output, base.store),
        "output tf32": Precision(base.intra, base.solve, base.wy, base.scan, "tf32", base.store),
        "fp32 store, tf32 scan/output": Precision(base.intra, base.solve, base.wy, "tf32", "tf32", torch.float32),
        "all tf32, fp32 store": Precision("tf32", "tf32", "tf32", "tf32", "tf32", torch.float32),
    }
    x1, xl = inputs(1, 1000, 32, seed=1), inputs(1, 32768, 32, seed=2)
    ref1, refl = oracle(x1), oracle(xl)
    lines = ["| precision (intra, solve, wy, scan, output, store) | o err T=1000 | state err T=1000 "
             "| o err T=32768 | state err T=32768 | ms B1 T32768 H32 |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, p in variants.items():
        with use_precision(torch.bfloat16, p):
            e1 = errors(call_ours(x1), ref1)
            el = errors(call_ours(xl), refl)
            ms = gpu_ms(lambda: call_ours(xl))
        desc = f"{name}: {p.intra}, {p.solve}, {p.wy}, {p.scan}, {p.output}, {str(p.store).replace('torch.', '')}"
        lines.append(f"| {desc} | {e1[0]:.2e} | {e1[1]:.2e} | {el[0]:.2e} | {el[1]:.2e} | {ms:.3f} |")
        print("  " + lines[-1], file=sys.stderr)
    if fla_fn is not None:
        e1, el = errors(call_fla(fla_fn, x1), ref1), errors(call_fla(fla_fn, xl), refl)
        lines.append(f"| fla | {e1[0]:.2e} | {e1[1]:.2e} | {el[0]:.2e} | {el[1]:.2e} | "
                     f"{gpu_ms(lambda: call_fla(fla_fn, xl)):.3f} |")  # fmt: skip
    return lines


def bv_sweep() -> list[str]:
    """Time of every value tile of the state scan at the benchmark shapes."""
    from kda_ops.triton.launch import force_forms

    lines = ["| BV | " + " | ".join(f"B{B} T{T} H{H} ms" for B, T, H in SHAPES) + " |", "|---|" + "---|" * len(SHAPES)]
    xs = [inputs(B, T, H) for B, T, H in SHAPES]
    for bv in (None, 16, 32, 64):
        with force_forms(scan_block_v=bv):
            cells = [f"{gpu_ms(lambda x=x: call_ours(x)):.3f}" for x in xs]
        lines.append(f"| {'auto' if bv is None else bv} | " + " | ".join(cells) + " |")
        print("  " + lines[-1], file=sys.stderr)
    return lines


def stage_calls(x: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """Each part of our forward on ``x`` alone, by name: the chunk map, the fused stages 1-3 that the forward runs,
    and the stage launchers one by one (stages 2 and 3 as the staged pipeline and the backward's recompute run
    them), each on the factors of the stages before it (computed once here)."""
    from kda_ops.triton.chunk import scan as ts
    from kda_ops.triton.chunk.output import chunk_output
    from kda_ops.triton.chunk.precision import precision_for
    from kda_ops.triton.chunk.prepare import chunk_prepare
    from kda_ops.triton.chunk.slots import slot_map
    from tests.triton.chunk.stage_kernels import chunk_intra, chunk_solve  # the standalone stage kernels

    B, T, H, _ = x["q"].shape
    opts = Options(use_qk_l2norm=True)
    p = precision_for(torch.bfloat16)
    f = {n: t.flatten(0, 1) for n, t in x.items()}
    slots = slot_map(None, B, T, x["q"].device)
    Mqk, Mkk, Qt, Kend, Kt, Gl = chunk_intra(f["q"], f["k"], f["g"], f["beta"], D**-0.5, slots, None, None, opts, p)
    Kt_timed = Kt.clone()  # the timed solve writes W over it, call after call (the values drift, not the time)
    _, W, U = chunk_solve(Mkk, Kt, f["v"], f["beta"], slots, opts, p, store_tm=False)
    final = torch.empty(B, H, D, D, device=x["q"].device)
    Hin, E = ts.chunk_state(W, U, Kend, Gl, None, slots.cu, p, final=final, offsets=slots.offset)
    # the forward's own path: the fused stages 1-3 in the X form (no W, U), its scan and output stage
    fw = chunk_prepare(f["q"], f["k"], f["v"], f["g"], f["beta"], D**-0.5, slots, None, None, opts, p)
    fH, fE = ts.chunk_state(fw.Kt, f["v"], fw.Kb, fw.Gl, None, slots.cu, p, final=final, offsets=slots.offset,
                            norms=fw.Nrm, x_form=True)  # fmt: skip
    return {
        "chunk map (slot_map: the drivers' one launch)": lambda: slot_map(None, B, T, x["q"].device),
        "stages 1-3 chunk_prepare (fused: the forward's path, X form)": lambda: chunk_prepare(
            f["q"], f["k"], f["v"], f["g"], f["beta"], D**-0.5, slots, None, None, opts, p),
        "stage 4 chunk_state (the forward's scan, X form)": lambda: ts.chunk_state(
            fw.Kt, f["v"], fw.Kb, fw.Gl, None, slots.cu, p, final=final, offsets=slots.offset, norms=fw.Nrm,
            x_form=True),
        "stage 5 chunk_output (the forward's)": lambda: chunk_output(
            fw.Qt, fw.MqkTb, fH, fE, slots, p, torch.bfloat16, norms=fw.Nrm),
        "stage 2 chunk_intra (Mqk, Mkk, Qt, Kend, Kt; cumsum fused; two passes)": lambda: chunk_intra(
            f["q"], f["k"], f["g"], f["beta"], D**-0.5, slots, None, None, opts, p),
        "stage 3 chunk_solve (W, U)": lambda: chunk_solve(
            Mkk, Kt_timed, f["v"], f["beta"], slots, opts, p, store_tm=False),
        "stage 4 chunk_state (the scan on the staged factors, E form)": lambda: ts.chunk_state(
            W, U, Kend, Gl, None, slots.cu, p, final=final, offsets=slots.offset),
        "stage 5 chunk_output (on the staged factors)": lambda: chunk_output(Qt, Mqk, Hin, E, slots, p,
                                                                           torch.bfloat16),
    }  # fmt: skip


def breakdown(B: int, T: int, H: int) -> list[str]:
    """Where the time goes at one shape: the public call, and each part of it alone (GPU ms)."""
    from kda_ops.triton.chunk import scan as ts
    from kda_ops.triton.launch import LAUNCH

    x = inputs(B, T, H)
    rows = {"chunk_kda (public function)": lambda: call_ours(x), **stage_calls(x)}
    lines = [f"| B{B} T{T} H{H}: part | ms |", "|---|---|"]
    for name, fn in rows.items():
        lines.append(f"| {name} | {gpu_ms(fn):.3f} |")
    lines.append(f"| launch configurations | {LAUNCH}, scan value tile {ts.scan_block_v(D, B * H, x['q'].device)} |")
    return lines


def accuracy_and_breakdown(fla_fn: Callable[..., Any] | None, quick: bool) -> tuple[list[str], list[str]]:
    """The error rows against the float64 reference (T = 1000, and T = 32768 unless ``quick``) and the breakdown of
    the first main shape into its parts."""
    print("accuracy", file=sys.stderr)
    x1 = inputs(1, 1000, 32, seed=1)
    ref1 = oracle(x1)
    acc = [error_row("ours", 1000, lambda: call_ours(x1), ref1)]
    if fla_fn is not None:
        acc.append(error_row("fla", 1000, lambda: call_fla(fla_fn, x1), ref1))
    if not quick:
        xl = inputs(1, 32768, 32, seed=2)
        refl = oracle(xl)
        acc.append(error_row("ours", 32768, lambda: call_ours(xl), refl))
        if fla_fn is not None:
            acc.append(error_row("fla", 32768, lambda: call_fla(fla_fn, xl), refl))
        del xl, refl
    torch.cuda.empty_cache()
    print("breakdown", file=sys.stderr)
    return acc, ["", "Breakdown (GPU ms, each part alone):", "", *breakdown(*SHAPES[0])]


def plot(rows: list[dict[str, Any]], path: Path, title: str, x: str = "T",
         ylabel: str = "forward, ms (median)") -> None:  # fmt: skip
    """Time against ``x`` (``"T"``: the T sweep; ``"H"``: the B·H sweep) on log axes; the peer's, SDPA's and the
    floor's lines where every row has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r[x] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["ours_ms"] for r in rows], "o-", label="kda_ops chunk_kda")
    if all(r["fla_ms"] is not None for r in rows):
        ax.plot(xs, [r["fla_ms"] for r in rows], "s-", label="fla-core 0.6.0 chunk_kda")
    if all(r.get("sdpa_ms") is not None for r in rows):
        ax.plot(xs, [r["sdpa_ms"] for r in rows], "^-", label="SDPA (causal)")
    if all(r.get("floor_ms") is not None for r in rows):
        ax.plot(xs, [r["floor_ms"] for r in rows], "k:", label="KDA memory floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if x == "T":
        ax.set_xlabel(f"T (B = {SWEEP_TOKENS} / T, H = {SWEEP_H}, K = V = {D}, bf16)")
    else:
        ax.set_xlabel(f"B·H (B = 1, T = {BH_SWEEP_T}, K = V = {D}, bf16)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--wheels", nargs="*", default=sorted(glob.glob(str(ROOT / ".whl" / "*.whl"))),
                        help="wheels to import fla from when it is not installed")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="no T sweep, no T = 32768 error")
    parser.add_argument("--precision-sweep", action="store_true")
    parser.add_argument("--sweep-bv", action="store_true")
    parser.add_argument("--bh-sweep", action="store_true", help=f"time B1 T{BH_SWEEP_T} at H in {BH_SWEEP_H}")
    parser.add_argument("--skip-fla", action="store_true",
                        help="leave fla out (its first call at each new shape autotunes for a long time)")  # fmt: skip
    parser.add_argument("--shapes", type=int, default=len(SHAPES),
                        help="time the first N main shapes (0: with --bh-sweep, the sweep alone)")  # fmt: skip
    parser.add_argument("--graph", action="store_true",
                        help="time the B·H sweep as CUDA-graph replays (the host's launches drop out)")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_chunk: needs a CUDA GPU")

    fla_fn, fla_note = (None, "fla skipped") if args.skip_fla else load_fla(args.wheels)
    print(fla_note, file=sys.stderr)
    bw = _bench.copy_bandwidth()
    print("shapes", file=sys.stderr)
    rows = []
    for B, T, H in SHAPES[: args.shapes]:
        rows.append(row(B, T, H, fla_fn, bw))
        torch.cuda.empty_cache()
    sweep: list[dict[str, Any]] = []
    if not args.quick and args.shapes > 0:
        print("T sweep", file=sys.stderr)
        for T in SWEEP_T:
            sweep.append(row(SWEEP_TOKENS // T, T, SWEEP_H, fla_fn, bw))
            torch.cuda.empty_cache()
    bh: list[dict[str, Any]] = []
    if args.bh_sweep:
        print("B·H sweep", file=sys.stderr)
        for H in BH_SWEEP_H:
            bh.append(row(1, BH_SWEEP_T, H, fla_fn, bw, args.graph))
            torch.cuda.empty_cache()

    acc: list[str] = []
    extra: list[str] = []
    if rows:  # the main shapes' companions: the errors and the breakdown (skipped with --shapes 0)
        acc, extra = accuracy_and_breakdown(fla_fn, args.quick)
    if args.precision_sweep:
        print("precision sweep", file=sys.stderr)
        extra += ["", "Precision of bf16 inputs (errors vs the float64 reference, H = 32):", ""]
        extra += precision_sweep(fla_fn)
    if args.sweep_bv:
        print("value-tile sweep", file=sys.stderr)
        extra += ["", "State-scan value tile (GPU ms):", ""] + bv_sweep()

    gpu = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}; {fla_note}"
    today = datetime.date.today().isoformat()
    header = [
        f"# Chunkwise KDA forward, {today}",
        "",
        f"GPU: {gpu}; {versions}. Copy bandwidth {bw / 1e9:.0f} GB/s (read + write).",
        f"K = V = {D}, bf16 q/k/v/beta, fp32 g = logsigmoid(randn), l2norm in kernel, final state out, no initial "
        "state. ms: do_bench median (L2 flushed). TFLOP/s: chunkwise products at C = 64 (KDA), causal attention "
        "(SDPA). GB: inputs read and outputs written once; floor = GB / copy bandwidth.",
        "",
    ]
    lines = header + table(rows)
    if sweep:
        lines += ["", f"T sweep at B * T = {SWEEP_TOKENS}, H = {SWEEP_H}:", ""] + table(sweep)
    if bh:
        timing = "CUDA-graph replays" if args.graph else "eager calls"
        lines += ["", f"B·H sweep at B = 1, T = {BH_SWEEP_T} ({timing}):", ""] + table(bh)
    lines += ["", "Relative error against the float64 reference (same bf16 inputs, H = 32):", "",
              "| implementation | T | o | final state |", "|---|---|---|---|"] + acc + extra  # fmt: skip
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_chunk.md").write_text(text)
    (args.out / "bench_chunk.json").write_text(json.dumps(
        {"date": today, "gpu": gpu, "versions": versions, "copy_bandwidth": bw, "shapes": rows, "sweep": sweep,
         "bh_sweep": bh, "bh_sweep_graph": args.graph, "accuracy": acc, "extra": extra}, indent=1))  # fmt: skip
    if sweep:
        try:
            plot(sweep, args.out / "bench_chunk.png", f"Chunkwise KDA forward, {gpu}")
        except Exception as e:  # noqa: BLE001 - no matplotlib: the table still stands
            print(f"no plot: {type(e).__name__}: {e}", file=sys.stderr)
    if bh:
        try:
            plot(bh, args.out / "bench_chunk_bh.png", f"Chunkwise KDA forward by heads, {gpu}", x="H")
        except Exception as e:  # noqa: BLE001 - no matplotlib: the table still stands
            print(f"no plot: {type(e).__name__}: {e}", file=sys.stderr)
    print(text)


if __name__ == "__main__":
    main()
