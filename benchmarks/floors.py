"""The floor of each chunk kernel: the bytes it must move and the products it must run, over the card's rates.

Every kernel of the chunkwise pipeline reads its inputs from memory and writes its outputs there once, at least;
its time cannot go below ``max(bytes / bandwidth, flops / rate)``. This script counts both per kernel from the
tensors the pipeline passes between its stages (``docs/architecture.md``; shapes and storage dtypes as the bf16
path keeps them: q, k, v, beta bf16, g fp32, the per-chunk factors in bf16 but ``Mqk`` and ``Tm`` of the backward in
fp32, the gradient of g in fp32 and those of q, k in bf16), with the chunk size C = 64:

- the inference forward (X form): the anchor sums, the prepare kernel, the scan, the output stage;
- the training forward (E form, its factors kept for the backward): the l2norm factors, prepare, scan, output;
- the backward: the reverse scan, the dv stage, the dq/dk stage (with the l2norm's gradient; the fp32 dq, dk it
  writes and reads back as scratch are not counted: no stage needs them).

A tensor a kernel reads again from L2 (the scan's key tiles, once per value tile) counts once. Products count
``2 m n k`` flops at the rate of their precision (bf16 for the scan's and the output's, TF32 for the rest; the
3xTF32 products three times). The rates default to an H200's dense tensor-core figures and the copy bandwidth
measured by ``bench_chunk.py`` on it.

Usage: ``python benchmarks/floors.py [--B 1] [--T 32768] [--H 32] [--D 128] [--bandwidth GBPS] [--bf16 TFLOPS]
[--tf32 TFLOPS]``; prints one markdown table.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

C = 64
BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Kernel:
    stage: str
    name: str
    read: float  # bytes
    write: float  # bytes
    bf16_flops: float
    tf32_flops: float


def kernels(B: int, T: int, H: int, D: int) -> list[Kernel]:
    """The kernels of the bf16 chunk pipeline at ``B, T, H`` heads (as many value heads) and K = V = ``D``."""
    K = V = D
    th = B * T * H  # token-heads
    S = B * (T // C) * H  # chunk-heads: one state [K, V] each
    mm = 2.0 * S  # a product's 2 m n k flops per chunk-head, times the chunk-heads
    state = S * K * V * BF16  # Hin or dS', stored in bf16
    final = B * H * K * V * FP32
    norms = 2 * th * FP32
    gl = S * K * FP32
    out: list[Kernel] = []

    def add(stage: str, name: str, read: float, write: float, bf16: float = 0.0, tf32: float = 0.0) -> None:
        out.append(Kernel(stage, name, read, write, bf16, tf32))

    # intra-chunk products shared by both forms of the prepare kernel: Mqk, Mkk; the solve's doubling steps (two on
    # the whole chunk, four on the 16-row diagonal blocks)
    intra = mm * 2 * C * C * K
    solve = mm * (2 * 2 * C**3 + 4 * 2 * 4 * 16**3)
    # inference forward, X form
    add("forward", "anchor sums", th * K * FP32, S * 3 * K * FP32)
    add("forward", "prepare (X form)", th * (2 * K * BF16 + K * FP32 + BF16) + S * 3 * K * FP32,
        th * (3 * K * BF16 + C * BF16) + gl + norms, tf32=intra + solve + mm * (C**3 + C * C * K))  # fmt: skip
    add("forward", "scan (X form)", th * (2 * K * BF16 + V * BF16 + FP32) + gl, state + th * V * BF16 + final,
        bf16=mm * 2 * C * K * V)  # fmt: skip
    add("forward", "output", th * (K * BF16 + C * BF16 + V * BF16 + FP32) + state, th * V * BF16,
        bf16=mm * (C * K * V + C * C * V))  # fmt: skip
    # training forward, E form
    add("training forward", "l2norm factors", 2 * th * K * BF16, norms)
    add("training forward", "prepare (E form)", th * (2 * K * BF16 + K * FP32 + V * BF16 + BF16) + norms,
        th * (2 * C * FP32 + 3 * K * BF16 + V * BF16) + gl,
        tf32=intra + solve + mm * (C * C * K + C * C * V))  # fmt: skip
    add("training forward", "scan (E form)", th * (2 * K * BF16 + V * BF16) + gl + norms / 2,
        state + th * V * BF16 + final, bf16=mm * 2 * C * K * V)  # fmt: skip
    add("training forward", "output (E form)", th * (K * BF16 + C * FP32 + V * BF16) + state + norms / 2,
        th * V * BF16, bf16=mm * (C * K * V + C * C * V))  # fmt: skip
    # backward
    add("backward", "reverse scan", th * (V * BF16 + C * FP32 + 3 * K * BF16) + gl + final,
        th * V * BF16 + state + final, tf32=mm * (3 * C * K * V + C * C * V))  # fmt: skip
    add("backward", "dv", th * (K * BF16 + V * BF16 + K * FP32 + BF16 + C * FP32 + 3 * V * BF16) + state + norms / 2,
        th * (V * BF16 + FP32 + 2 * C * BF16 + K * BF16 + K * FP32),
        tf32=mm * (3 * C * C * V + C * K * V + 2 * C * C * K + 3 * 2 * C**3))  # fmt: skip
    add("backward", "dq/dk", th * (2 * K * BF16 + K * FP32 + BF16 + 2 * C * BF16 + K * BF16 + 2 * V * BF16 + FP32)
        + gl + 2 * state + norms, th * (2 * K * BF16 + K * FP32 + FP32),
        tf32=mm * (4 * C * C * K), bf16=mm * 2 * C * K * V)  # fmt: skip
    return out


def table(ks: list[Kernel], bandwidth: float, bf16_rate: float, tf32_rate: float) -> list[str]:
    """Markdown rows: per kernel its GB, GFLOP and the floor in ms (bytes and products each, and the larger)."""
    lines = ["| stage | kernel | GB | GFLOP | bytes ms | products ms | floor ms |", "|---|---|---|---|---|---|---|"]
    totals: dict[str, float] = {}
    for k in ks:
        gb = (k.read + k.write) / 1e9
        byte_ms = (k.read + k.write) / bandwidth * 1e3
        flop_ms = (k.bf16_flops / bf16_rate + k.tf32_flops / tf32_rate) * 1e3
        floor = max(byte_ms, flop_ms)
        totals[k.stage] = totals.get(k.stage, 0.0) + floor
        lines.append(f"| {k.stage} | {k.name} | {gb:.2f} | {(k.bf16_flops + k.tf32_flops) / 1e9:.0f} | "
                     f"{byte_ms:.3f} | {flop_ms:.3f} | {floor:.3f} |")  # fmt: skip
    for stage, ms in totals.items():
        lines.append(f"| {stage} | all kernels | | | | | **{ms:.3f}** |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--D", type=int, default=128, help="K = V")
    ap.add_argument("--bandwidth", type=float, default=4246.0, help="copy bandwidth, GB/s")
    ap.add_argument("--bf16", type=float, default=989.0, help="dense bf16 tensor-core rate, TFLOP/s")
    ap.add_argument("--tf32", type=float, default=494.0, help="dense TF32 tensor-core rate, TFLOP/s")
    args = ap.parse_args()
    print(f"Floors at B{args.B} T{args.T} H{args.H} K = V = {args.D}: {args.bandwidth:.0f} GB/s, bf16 "
          f"{args.bf16:.0f} and TF32 {args.tf32:.0f} TFLOP/s\n")  # fmt: skip
    ks = kernels(args.B, args.T, args.H, args.D)
    print("\n".join(table(ks, args.bandwidth * 1e9, args.bf16 * 1e12, args.tf32 * 1e12)))


if __name__ == "__main__":
    main()
