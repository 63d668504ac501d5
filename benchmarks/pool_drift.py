"""Drift of a bfloat16 state pool against a float32 one over many decode steps.

Both pools start from the same states and take the same tokens through ``kda_ops.recurrent_kda_update_``; a float64
pool, updated by the same op on float64 copies of the tokens, is the reference. Printed per checkpoint: the relative
error (``kda_ops.testing.rel_err``) of the bf16 pool's states and outputs against the fp32 pool's, and of the fp32
pool's against the float64 one. Two gates: typical decays (``g = logsigmoid(randn)``) and slow ones (divided by 16,
a long memory, where each step's rounding is carried furthest).

Usage: ``python benchmarks/pool_drift.py [--steps 1000] [--B 4] [--H 4] [--D 128] [--device cpu|cuda]`` (on the
CPU it runs the reference kernel; the Triton kernel rounds the same way, once per stored state).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kda_ops
from kda_ops.testing import rel_err


def drift(
    steps: int, B: int, H: int, D: int, slow: float, device: str, every: int
) -> list[tuple[int, float, float, float]]:
    gen = torch.Generator(device=device).manual_seed(0)
    pool64 = torch.randn(B, H, D, D, generator=gen, device=device, dtype=torch.float64) * 0.1
    pool32, pool16 = pool64.float(), pool64.bfloat16()
    idx = torch.arange(B, device=device)
    rows = []
    for t in range(steps):
        x = {n: torch.randn(B, 1, H, D, generator=gen, device=device) for n in ("q", "k", "v", "g")}
        x["g"] = F.logsigmoid(x["g"]) / slow
        x["beta"] = torch.rand(B, 1, H, generator=gen, device=device)
        x16 = {n: (t_.bfloat16() if n != "g" else t_) for n, t_ in x.items()}
        opts = dict(use_qk_l2norm_in_kernel=True)
        kda_ops.recurrent_kda_update_(**{n: t_.double() for n, t_ in x16.items()}, state_pool=pool64,
                                      state_indices=idx, **opts)  # fmt: skip
        o32 = kda_ops.recurrent_kda_update_(**x16, state_pool=pool32, state_indices=idx, **opts)
        o16 = kda_ops.recurrent_kda_update_(**x16, state_pool=pool16, state_indices=idx, **opts)
        if (t + 1) % every == 0:
            rows.append((t + 1, rel_err(pool16.float(), pool32), rel_err(o16.float(), o32.float()),
                         rel_err(pool32.double(), pool64)))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| gate | steps | bf16 pool vs fp32: state | o | fp32 pool vs fp64: state |\n|---|---|---|---|---|")
    for name, slow in (("logsigmoid(randn)", 1.0), ("logsigmoid(randn) / 16", 16.0)):
        for step, e_s, e_o, e_32 in drift(args.steps, args.B, args.H, args.D, slow, args.device, args.steps // 4):
            print(f"| {name} | {step} | {e_s:.2e} | {e_o:.2e} | {e_32:.2e} |")


if __name__ == "__main__":
    main()
