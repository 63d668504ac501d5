"""Decode-step benchmark of the fused recurrent KDA kernels, against fla-core's ``fused_recurrent_kda``.

One decode step: every sequence gets one token (T = 1), H = HV = 32, K = V = 128, bf16 inputs, fp32 state,
``use_qk_l2norm_in_kernel=True``. Measured in one run, for B in {1, 16, 64, 256}:

- ``serving``: ``kda_ops.recurrent_kda_update_`` on a pool of 2B states at random slots (in place);
- ``recurrent``: ``kda_ops.recurrent_kda`` with an initial state and the final state returned;
- ``fla``: ``fla.ops.kda.fused_recurrent_kda`` with the same arguments as ``recurrent`` (when importable);

each eager and replayed from a CUDA graph. GPU times are ``triton.testing.do_bench`` medians (the L2 cache is
flushed before every repetition, so the state comes from HBM); ``wall`` is the host-side time per call of
back-to-back eager calls (what an eager decode loop pays when the host is the bottleneck, as it is at B = 1).
The floor is the state traffic of one step, ``2 * B * H * K * V * 4`` bytes, over the device-to-device copy
bandwidth measured in the same run (a torch copy of a large tensor: bytes read + written over its time).

fla is imported from the environment, or from wheels given by ``--wheels`` (default: ``.whl/*.whl`` of the
repository, e.g. fla_core-0.6.0 and einops), unpacked into a temporary folder at run time.

Usage: ``python benchmarks/bench_recurrent.py [--out FILE] [--sweep] [--sweep-maxnreg N ...] [--sweep-pool bf16]
[--sweep-v-first] [--backward] [--skip-fla]``. The markdown table comes last. ``--sweep`` times the serving step
(graph-replayed) for every value tile / warp count, the numbers behind the fixed launch configuration in
``kda_ops/triton/launch.py`` (``recurrent_config``), on an fp32 pool or with ``--sweep-pool bf16`` a bf16 one, K-first
or with ``--sweep-v-first`` V-first; ``--sweep-maxnreg`` times the configured launch under each register cap.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _bench  # noqa: E402

import kda_ops  # noqa: E402
from kda_ops.testing import make_inputs, make_state  # noqa: E402

H = HV = 32
K = V = 128
BATCHES = (1, 16, 64, 256)
DEV = "cuda"


def load_fla(wheels: list[str]) -> tuple[Callable[..., Any] | None, str]:
    """``fused_recurrent_kda`` and a description of where it came from (or why it is missing)."""
    return _bench.load_fla(wheels, "fused_recurrent_kda")


def gpu_us(fn: Callable[[], Any]) -> float:
    """Median GPU time of ``fn`` in microseconds (do_bench flushes L2 before each repetition)."""
    return float(do_bench(fn, warmup=50, rep=300, return_mode="median")) * 1e3


def decode_inputs(B: int) -> dict[str, Any]:
    x = make_inputs(B, 1, H, K, V, HV=HV, dtype=torch.bfloat16, device=DEV, seed=B)
    x["h0"] = make_state(B, HV, K, V, device=DEV)
    x["pool"] = make_state(2 * B, HV, K, V, device=DEV, seed=2)
    x["idx"] = torch.randperm(2 * B, device=DEV)[:B].to(torch.int32)
    return x


def workloads(x: dict[str, Any], fla_fn: Callable[..., Any] | None) -> dict[str, Callable[[], Any]]:
    qkvgb = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    out: dict[str, Callable[[], Any]] = {
        "serving": lambda: kda_ops.recurrent_kda_update_(
            **qkvgb, state_pool=x["pool"], state_indices=x["idx"], use_qk_l2norm_in_kernel=True,
            state_v_first=x.get("v_first", False),
        ),
        "recurrent": lambda: kda_ops.recurrent_kda(
            **qkvgb, initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True
        ),
    }
    if fla_fn is not None:
        out["fla"] = lambda: fla_fn(
            **qkvgb, initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True
        )
    return out


def measure(name: str, fn: Callable[[], Any]) -> dict[str, float | str]:
    res: dict[str, float | str] = {}
    with torch.no_grad():
        fn()  # compile
        res["eager"] = gpu_us(fn)
        res["wall"] = _bench.host_us(fn)
        with torch.inference_mode():
            res["wall_inf"] = _bench.host_us(fn)
        try:
            graph, _ = _bench.capture(fn)
            res["graph"] = gpu_us(graph.replay)
            res["cold"] = _bench.cold_us(graph.replay)
        except Exception as e:  # noqa: BLE001 - a peer that cannot be captured is reported, not fatal
            res["graph"] = res["cold"] = f"capture failed: {type(e).__name__}"
            print(f"  {name}: CUDA graph capture failed: {e}", file=sys.stderr)
    return res


def fmt(x: float | str) -> str:
    return f"{x:.1f}" if isinstance(x, float) else str(x)


def breakdown(fla_fn: Callable[..., Any] | None) -> list[tuple[str, float]]:
    """Host cost per eager call at B = 1, layer by layer (wall-clock µs per call, back to back)."""
    from kda_ops.common import Options
    from kda_ops.triton import KERNELS
    from kda_ops.triton.recurrent.forward import launch_forward

    x = decode_inputs(1)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    opts = Options(use_qk_l2norm=True)
    o, ht = torch.empty_like(v), torch.empty_like(h0)
    scale = K**-0.5
    rows = [
        ("launch_forward (Triton launch, preallocated outputs)",
         lambda: launch_forward(q, k, v, g, beta, o, h0, ht, None, None, None, None, scale, opts)),
        ('KERNELS["recurrent"] (+ output allocation)',
         lambda: KERNELS["recurrent"](q, k, v, g, beta, scale, h0, None, None, None, opts, True)),
        ("torch.ops.kda.recurrent (+ dispatcher, autograd wrapper)",
         lambda: torch.ops.kda.recurrent(q, k, v, g, beta, scale, h0, None, None, None, None, True, True, False,
                                         False, False)),
        ("kda_ops.recurrent_kda (+ validation)",
         lambda: kda_ops.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)),
        ('KERNELS["recurrent_update_"] (serving launcher)',
         lambda: KERNELS["recurrent_update_"](q, k, v, g, beta, x["pool"], x["idx"], scale, None, None, None, opts)),
        ("torch.ops.kda.recurrent_update_ (+ dispatcher)",
         lambda: torch.ops.kda.recurrent_update_(q, k, v, g, beta, x["pool"], x["idx"], scale, None, None, None,
                                                 None, True, False, False, False)),
        ("kda_ops.recurrent_kda_update_ (+ validation)",
         lambda: kda_ops.recurrent_kda_update_(q, k, v, g, beta, x["pool"], x["idx"], use_qk_l2norm_in_kernel=True)),
    ]  # fmt: skip
    if fla_fn is not None:
        rows.append(("fla fused_recurrent_kda",
                     lambda: fla_fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)))  # fmt: skip
    out = []
    for label, fn in rows:
        out.append((label, _bench.host_us(fn, iters=2000)))
        with torch.no_grad():
            out.append((label + ", no_grad", _bench.host_us(fn, iters=2000)))
    return out


def sweep(batches: tuple[int, ...], pool_dtype: torch.dtype = torch.float32, v_first: bool = False) -> str:
    """Graph-replayed serving step for each (BV, num_warps) on a pool of ``pool_dtype`` (its states ``[V, K]`` with
    ``v_first``): the data behind the fixed launch configuration."""
    import kda_ops.triton.recurrent.forward as tr

    original = tr.recurrent_config
    lines = ["| BV | num_warps | " + " | ".join(f"B={B} µs" for B in batches) + " |",
             "|---|---|" + "---|" * len(batches)]  # fmt: skip
    inputs = {B: decode_inputs(B) for B in batches}
    for x in inputs.values():
        x["pool"] = x["pool"].to(pool_dtype)
        x["v_first"] = v_first
    try:
        for BV in (8, 16, 32, 64, 128):
            for nw in (1, 2, 4, 8):
                if triton.next_power_of_2(K) * BV // (32 * nw) > 128:  # state elements per thread: would spill
                    continue
                tr.recurrent_config = lambda K, V, *_, BV=BV, nw=nw: (triton.next_power_of_2(K), BV, nw)  # type: ignore[misc]
                tr._forward_meta.cache_clear()
                lines.append(f"| {BV} | {nw} | " + " | ".join(_serving_cells(inputs)) + " |")
                print(lines[-1], file=sys.stderr)
    finally:
        tr.recurrent_config = original
        tr._forward_meta.cache_clear()
    return "\n".join(lines)


def _serving_cells(inputs: dict[int, dict[str, Any]]) -> list[str]:
    """The graph-replayed serving step's GPU µs for each batch's inputs, under the launch configuration in force."""
    cells = []
    for x in inputs.values():
        try:
            fn = workloads(x, None)["serving"]
            with torch.no_grad():
                fn()
                cells.append(f"{gpu_us(_bench.capture(fn)[0].replay):.1f}")
        except Exception as e:  # noqa: BLE001
            cells.append(f"failed ({type(e).__name__})")
    return cells


def maxnreg_sweep(batches: tuple[int, ...], pool_dtype: torch.dtype, v_first: bool, caps: list[int]) -> str:
    """Graph-replayed serving step at the configured tile and warps, uncapped and under each register cap per thread
    in ``caps`` (more one-warp programs per SM where the kernel then does not spill)."""
    import kda_ops.triton.recurrent.forward as tr

    original = tr._forward_meta
    lines = ["| maxnreg | " + " | ".join(f"B={B} µs" for B in batches) + " |", "|---|" + "---|" * len(batches)]
    inputs = {B: decode_inputs(B) for B in batches}
    for x in inputs.values():
        x["pool"] = x["pool"].to(pool_dtype)
        x["v_first"] = v_first
    try:
        for cap in (None, *caps):

            def capped(*a: Any, cap: int | None = cap) -> tuple[int, dict[str, Any], tuple[Any, ...]]:
                nv, meta, key = original(*a)
                return (nv, meta, key) if cap is None else (nv, {**meta, "maxnreg": cap}, (*key, "maxnreg", cap))

            tr._forward_meta = capped  # type: ignore[assignment]
            lines.append(f"| {cap or '-'} | " + " | ".join(_serving_cells(inputs)) + " |")
            print(lines[-1], file=sys.stderr)
    finally:
        tr._forward_meta = original
    return "\n".join(lines)


def backward_timing() -> str:
    """Forward + backward of recurrent_kda on a short-sequence training shape (no peer has this backward)."""
    B, T = 4, 512
    x = make_inputs(B, T, H, K, V, HV=HV, dtype=torch.bfloat16, device=DEV, gate_in_kernel=True, beta_logits=True)
    leaves = {n: t.requires_grad_() for n, t in x.items()}
    h0 = make_state(B, HV, K, V, device=DEV).requires_grad_()
    do = torch.randn(B, T, HV, V, device=DEV, dtype=torch.bfloat16)
    opts = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}

    def fwd() -> Any:
        return kda_ops.recurrent_kda(**leaves, initial_state=h0, output_final_state=True, **opts)

    def fwd_bwd() -> None:
        o, _ = fwd()
        o.backward(do)

    fwd_bwd()
    with torch.no_grad():
        t_f = gpu_us(lambda: fwd())
    t_fb = gpu_us(fwd_bwd)
    return (f"recurrent_kda B={B} T={T} H={H} K=V={K} bf16, every in-kernel option: forward {t_f:.0f} µs, "
            f"forward + backward {t_fb:.0f} µs")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _bench.table_and_wheel_arguments(parser)
    parser.add_argument("--sweep", action="store_true", help="time every value tile / warp count")
    parser.add_argument("--sweep-pool", choices=("fp32", "bf16"), default="fp32",
                        help="the state pool's dtype in --sweep (a bf16 pool moves half the bytes a step)")  # fmt: skip
    parser.add_argument("--sweep-v-first", action="store_true", help="the sweep on a V-first pool ([V, K] states)")
    parser.add_argument("--sweep-maxnreg", type=int, nargs="*", default=None, metavar="N",
                        help="time the serving step as configured under each register cap N (with --sweep-pool, "
                             "--sweep-v-first)")  # fmt: skip
    parser.add_argument("--backward", action="store_true", help="also time forward + backward (B=4, T=512)")
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--skip-fla", action="store_true", help="leave fla out: time kda_ops only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_recurrent: needs a CUDA GPU")

    fla_fn, fla_note = (None, "fla skipped") if args.skip_fla else load_fla(args.wheels)
    print(fla_note, file=sys.stderr)
    bw = _bench.copy_bandwidth()
    header = [
        f"# Decode step (recurrent KDA), {datetime.date.today().isoformat()}",
        "",
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; {fla_note}.",
        f"H = HV = {H}, K = V = {K}, T = 1 per sequence, bf16 inputs, fp32 state, l2norm in kernel. "
        f"Copy bandwidth {bw / 1e9:.0f} GB/s (read + write); floor = 2·B·H·K·V·4 B / bandwidth.",
        "GPU µs: do_bench median (L2 flushed by zeroing a 256 MB buffer); graph cold: the replay's median with the "
        "L2 flushed by reading that buffer instead (`_bench.cold_us`: no dirty lines to write back inside the timed "
        "step). wall: host µs per back-to-back eager call under no_grad; wall inf.: the same under "
        "torch.inference_mode.",
        "",
    ]
    cols = ["serving", "recurrent"] + (["fla"] if fla_fn is not None else [])
    table = ["| B | floor µs | " + " | ".join(f"{c} eager | {c} wall | {c} wall inf. | {c} graph | {c} graph cold"
                                           for c in cols)
             + " | recurrent graph / floor | recurrent graph cold / floor |",
             "|---|---|" + "---|---|---|---|---|" * len(cols) + "---|---|"]  # fmt: skip
    for B in args.batches:
        x = decode_inputs(B)
        floor = 2 * B * H * K * V * 4 / bw * 1e6
        res = {name: measure(name, fn) for name, fn in workloads(x, fla_fn).items()}
        cells = [f"{B}", f"{floor:.1f}"]
        for c in cols:
            cells += [fmt(res[c][m]) for m in ("eager", "wall", "wall_inf", "graph", "cold")]
        for m in ("graph", "cold"):
            g = res["recurrent"][m]
            cells.append(f"{g / floor:.2f}" if isinstance(g, float) else "-")
        table.append("| " + " | ".join(cells) + " |")
        print(table[-1], file=sys.stderr)

    extra = ["", "Host cost per eager call at B = 1 (wall µs, back to back):", "", "| path | µs |", "|---|---|"]
    extra += [f"| {label} | {us:.1f} |" for label, us in breakdown(fla_fn)]
    if args.backward:
        extra += ["", backward_timing()]
    if args.sweep:
        pool_dtype = torch.bfloat16 if args.sweep_pool == "bf16" else torch.float32
        layout = "V-first" if args.sweep_v_first else "K-first"
        extra += ["", f"Launch configuration sweep (serving step, {args.sweep_pool} {layout} pool, CUDA graph, GPU "
                  "µs):", "", sweep(tuple(args.batches), pool_dtype, args.sweep_v_first)]  # fmt: skip
    if args.sweep_maxnreg:
        pool_dtype = torch.bfloat16 if args.sweep_pool == "bf16" else torch.float32
        layout = "V-first" if args.sweep_v_first else "K-first"
        extra += ["", f"Register caps (serving step as configured, {args.sweep_pool} {layout} pool, CUDA graph, GPU "
                  "µs):", "", maxnreg_sweep(tuple(args.batches), pool_dtype, args.sweep_v_first, args.sweep_maxnreg)]
    text = "\n".join(header + table + extra) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
