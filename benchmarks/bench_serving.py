"""Serving-step benchmark: the pool forms of the serving ops under CUDA graphs.

Rows (H = HV = 32, K = V = 128, bf16 tokens, l2norm in kernel, slots a random permutation of a pool of 2B):

- decode step B = 64, T = 1, an fp32 pool and a bf16 pool (half the state bytes), K-first and V-first; floor: the
  state traffic of one step, ``2 * B * H * K * V * bytes`` over the copy bandwidth of the same run;
- speculative verify, B = 64 with 4 draft tokens (2-D slots, ``num_accepted_tokens``) against 4 single-token steps;
- prefill into the pool, B = 8, T = 4096 (``chunk_kda_update_``) against gather -> ``chunk_kda`` -> scatter.

GPU µs are ``triton.testing.do_bench`` medians of one CUDA-graph capture replayed (``_bench.capture``).

Usage: ``python benchmarks/bench_serving.py [--out FILE]``; the markdown table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

import kda_ops  # noqa: E402

DEV = "cuda"
H, D = 32, 128
OPTS: dict[str, Any] = {"use_qk_l2norm_in_kernel": True}


def tokens(B: int, T: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = {n: torch.randn(B, T, H, D, generator=gen, device=DEV).bfloat16() for n in ("q", "k", "v")}
    x["g"] = F.logsigmoid(torch.randn(B, T, H, D, generator=gen, device=DEV))
    x["beta"] = torch.rand(B, T, H, generator=gen, device=DEV).bfloat16()
    return x


def graph_us(fn: Callable[[], Any]) -> float:
    graph, _ = _bench.capture(fn)
    return float(do_bench(graph.replay, warmup=50, rep=300, return_mode="median")) * 1000


def decode_rows(bandwidth: float) -> list[str]:
    B = 64
    x = tokens(B, 1, 0)
    idx = torch.randperm(2 * B, device=DEV)[:B]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for v_first in (False, True):
            pool = torch.randn(2 * B, H, D, D, device=DEV).to(dtype)
            def step(pool: torch.Tensor = pool, v_first: bool = v_first) -> Any:
                return kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=idx, state_v_first=v_first,
                                                     **OPTS)  # fmt: skip

            us = graph_us(step)
            floor = 2 * B * H * D * D * pool.element_size() / bandwidth * 1e6
            name = f"decode B{B}, {str(dtype).split('.')[-1]} pool, {'V' if v_first else 'K'}-first"
            rows.append(f"| {name} | {us:.1f} | {floor:.1f} | {us / floor:.2f} |")
            print("  " + rows[-1], file=sys.stderr)
    return rows


def speculative_rows() -> list[str]:
    B, Ts = 64, 4
    x = tokens(B, Ts, 1)
    pool = torch.randn(B * Ts + B, H, D, D, device=DEV)
    slots = torch.randperm(pool.shape[0], device=DEV)[: B * Ts].view(B, Ts)
    acc = torch.randint(1, Ts + 1, (B,), device=DEV)
    verify = graph_us(lambda: kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=slots,
                                                            num_accepted_tokens=acc, **OPTS))  # fmt: skip
    outputs_only = graph_us(lambda: kda_ops.recurrent_kda_update_(**x, state_pool=pool, state_indices=slots,
                                                                  num_accepted_tokens=acc, write_states=False,
                                                                  **OPTS))  # fmt: skip
    steps = [{n: t[:, i : i + 1] for n, t in x.items()} for i in range(Ts)]
    one = slots[:, 0].contiguous()

    def four() -> None:
        for s in steps:
            kda_ops.recurrent_kda_update_(**s, state_pool=pool, state_indices=one, **OPTS)

    singles = graph_us(four)
    return [f"| verify B{B}, {Ts} drafts (a state per token) | {verify:.1f} | - | - |",
            f"| verify B{B}, {Ts} drafts, write_states=False | {outputs_only:.1f} | - | - |",
            f"| {Ts} single-token steps B{B} | {singles:.1f} | - | - |"]  # fmt: skip


def prefill_rows() -> list[str]:
    B, T = 8, 4096
    x = tokens(B, T, 2)
    pool = torch.randn(2 * B, H, D, D, device=DEV)
    idx = torch.randperm(2 * B, device=DEV)[:B]
    kda_ops.warmup(**x, initial_state=pool[idx], output_final_state=True, **OPTS)
    into = graph_us(lambda: kda_ops.chunk_kda_update_(**x, state_pool=pool, state_indices=idx, **OPTS))

    def copies() -> None:
        _, s = kda_ops.chunk_kda(**x, initial_state=pool[idx], output_final_state=True, **OPTS)
        pool.index_copy_(0, idx, s)

    around = graph_us(copies)
    return [f"| prefill into the pool B{B} T{T} (chunk_kda_update_) | {into:.1f} | - | - |",
            f"| gather -> chunk_kda -> scatter B{B} T{T} | {around:.1f} | - | - |"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    parser.add_argument("--skip-fla", action="store_true", help="accepted for symmetry: no peer is timed here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_serving: needs a CUDA GPU")
    bandwidth = _bench.copy_bandwidth()
    rows = decode_rows(bandwidth) + speculative_rows() + prefill_rows()
    lines = [f"# Serving steps, {datetime.date.today().isoformat()}", "",
             f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; copy "
             f"bandwidth {bandwidth / 1e9:.0f} GB/s.", "",
             "| step | graph µs | floor µs | / floor |", "|---|---|---|---|", *rows]  # fmt: skip
    _bench.emit(lines, args.out)


if __name__ == "__main__":
    main()
