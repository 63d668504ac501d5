"""Launch configurations of the chunk kernels side by side: the forward (and with ``--backward`` the forward +
backward) at the configured launch and at each variant given, in one process.

A variant changes entries of :data:`kda_ops.triton.launch.LAUNCH` for the length of its timing:
``STAGE:KEY=VALUE[,KEY=VALUE...]``, several stages joined by ``+``; for example ``prepare:BK=16``,
``prepare:BK=16,maxnreg=168`` or ``prepare:num_stages=2+dqk:num_warps=4``. Keys are those of the table's entries
(``num_warps``, ``num_stages``, the stage's tiles ``BK``/``BV``), ``maxnreg``, a register cap per thread, and the
stage's schedule flags, :data:`kda_ops.triton.launch.SCHEDULE_FLAGS` (``dqk:PREFETCH=2,HOLD_DM=1``,
``dv:LATE_STORE=1``; with ``--dtype fp16`` the dq/dk stage launches as ``dqk_split``). The
pseudo-stage ``forms`` forces the kernel forms of :func:`kda_ops.triton.force_forms` instead: ``forms:scan_segments=4``
(the split scan's segments per sequence), ``forms:scan_block_v=32``, ``forms:output_per_item=1``. ``--graph`` times
each call as a CUDA-graph replay (a short prompt, where an eager call measures the host).

Inputs are ``bench_chunk.py``'s (bf16, or fp16 with ``--dtype fp16``; K = V = 128, l2norm in kernel, final state
out); the backward takes a random ``do`` (in the inputs' dtype) and ``dht`` (fp32), as ``bench_chunk_bwd.py`` does.
Columns: GPU ms (``triton.testing.do_bench`` median after a compiling call, L2 flushed), and the largest absolute
difference of the outputs (with ``--backward``: of every gradient) from the configured launch's; a variant whose
products group their sums differently (other warps, another key tile, and as compiled the dv stage's ``PREFETCH``)
rounds differently, so a small difference is expected there, 0 elsewhere.

Usage: ``python benchmarks/bench_launch.py [--shapes B,T,H ...] [--backward] [--dtype fp16] [--graph] [--out DIR]
VARIANT ...``; the table is printed last and written to ``DIR/bench_launch.md`` when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_chunk  # noqa: E402
import bench_chunk_bwd  # noqa: E402

import kda_ops  # noqa: E402
from kda_ops.triton import force_forms, launch  # noqa: E402

KEYS = ("num_warps", "num_stages", "BK", "BV", "maxnreg")
FORMS = ("scan_segments", "scan_block_v", "output_per_item")
DEFAULT_SHAPES = ["1,32768,32", "8,4096,32", "1,32768,4"]


def parse_variant(text: str) -> dict[str, dict[str, int]]:
    """``"prepare:BK=16,maxnreg=168+dqk:num_warps=4"`` as ``{"prepare": {"BK": 16, "maxnreg": 168}, "dqk":
    {"num_warps": 4}}``; a ValueError names what is wrong."""
    out: dict[str, dict[str, int]] = {}
    for part in text.split("+"):
        stage, sep, items = part.partition(":")
        if not sep or (stage not in launch.LAUNCH and stage != "forms"):
            raise ValueError(f"variant {text!r}: expected STAGE:KEY=VALUE with STAGE one of "
                             f"{sorted(launch.LAUNCH)} or forms")  # fmt: skip
        keys = FORMS if stage == "forms" else (*KEYS, *launch.SCHEDULE_FLAGS.get(stage, ()))
        entry = out.setdefault(stage, {})
        for item in items.split(","):
            key, eq, value = item.partition("=")
            if not eq or key not in keys or not value.isdigit():
                raise ValueError(f"variant {text!r}: expected KEY=INTEGER with KEY one of {keys}, got {item!r}")
            entry[key] = int(value)
    return out


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"1,32768,32"`` as ``(1, 32768, 32)``; a ValueError names what is wrong."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--shapes: expected B,T,H (three integers), got {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def sort_arguments(variants: Sequence[str], shapes: Sequence[str]) -> tuple[list[str], list[str]]:
    """Variants given after ``--shapes`` (which takes every word up to the next option) moved back to the variants:
    a variant names a stage (``STAGE:...``), a shape never holds a colon."""
    return [*variants, *(s for s in shapes if ":" in s)], [s for s in shapes if ":" not in s]


@contextlib.contextmanager
def launched(variant: dict[str, dict[str, int]]) -> Iterator[None]:
    """The launch table with ``variant``'s entries changed (and its forms forced), restored on exit."""
    forms = variant.get("forms", {})
    saved = {stage: dict(launch.LAUNCH[stage]) for stage in variant if stage != "forms"}
    try:
        for stage in saved:
            launch.LAUNCH[stage].update(variant[stage])
        per_item = forms.get("output_per_item")
        with force_forms(scan_block_v=forms.get("scan_block_v"), scan_segments=forms.get("scan_segments"),
                         output_per_item=None if per_item is None else bool(per_item)):  # fmt: skip
            yield
    finally:
        for stage, entry in saved.items():
            launch.LAUNCH[stage].clear()
            launch.LAUNCH[stage].update(entry)


def max_diff(got: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None]) -> float:
    return max(((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref, strict=True)
                if a is not None and b is not None), default=0.0)  # fmt: skip


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def measure(shape: tuple[int, int, int], backward: bool, graph: bool,
            dtype: torch.dtype = torch.bfloat16) -> tuple[Callable[[], list[Any]], Callable[[], float]]:  # fmt: skip
    """The call at ``shape`` (returning the tensors to compare) and its timing (of a CUDA-graph replay with
    ``graph``); ``dtype``: of q, k, v, beta and ``do`` (the gate's log decay stays fp32)."""
    B, T, H = shape
    x = {n: t if n == "g" else t.to(dtype) for n, t in bench_chunk.inputs(B, T, H).items()}
    if not backward:

        def call() -> list[Any]:
            with torch.no_grad():
                return list(bench_chunk.call_ours(x))

        return call, lambda: bench_chunk.gpu_ms(call, graph)
    gen = torch.Generator(device=bench_chunk.DEV).manual_seed(9)
    do = torch.randn(x["v"].shape, generator=gen, device=bench_chunk.DEV).to(dtype)
    dht = torch.randn(B, H, bench_chunk.D, bench_chunk.D, generator=gen, device=bench_chunk.DEV)
    run = bench_chunk_bwd.fwd_bwd(kda_ops.chunk_kda, x, do, dht)
    return lambda: [g.clone() if g is not None else None for g in run()], lambda: bench_chunk_bwd.timed(run, graph)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("variants", nargs="*", help="STAGE:KEY=VALUE[,KEY=VALUE...][+STAGE:...]")
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="B,T,H of each shape")
    ap.add_argument("--backward", action="store_true", help="time forward + backward and compare the gradients")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="of q, k, v, beta (and do)")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (short prompts)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to DIR/bench_launch.md")
    ap.add_argument("--skip-fla", action="store_true", help="accepted for the common flags (no peer is timed)")
    args = ap.parse_args()
    try:
        texts, shape_texts = sort_arguments(args.variants, args.shapes)
        variants = {"as configured": {}, **{text: parse_variant(text) for text in texts}}
        shapes = [parse_shape(text) for text in shape_texts or DEFAULT_SHAPES]
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        sys.exit("bench_launch: needs a CUDA GPU")
    what = "forward + backward" if args.backward else "forward"
    head = ["launch", *(f"B{B} T{T} H{H} ms" for B, T, H in shapes), "max diff"]
    lines = [
        f"{what.capitalize()} by launch, {datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, torch "
        f"{torch.__version__}, triton {triton.__version__} ({args.dtype}, K = V = {bench_chunk.D})",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    results: dict[str, list[str]] = {name: [] for name in variants}
    diffs: dict[str, float] = dict.fromkeys(variants, 0.0)
    for shape in shapes:
        call, timing = measure(shape, args.backward, args.graph, DTYPES[args.dtype])
        ref: list[Any] | None = None
        for name, variant in variants.items():
            with launched(variant):
                try:
                    got = call()
                    ref = got if ref is None else ref
                    diffs[name] = max(diffs[name], max_diff(got, ref))
                    ms = timing()
                    results[name].append(f"{ms:.3f}")
                except Exception as e:  # noqa: BLE001 - a variant that fails to build or launch is reported
                    results[name].append(f"failed: {type(e).__name__}")
            print(f"  {shape} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
        del call, timing, ref
        torch.cuda.empty_cache()
    for name in variants:
        lines.append(f"| {name} | " + " | ".join(results[name]) + f" | {diffs[name]:.1e} |")
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_launch.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
