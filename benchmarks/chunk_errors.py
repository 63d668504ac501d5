"""Errors of the chunk forward and backward against float64 at the benchmark's shapes, and their determinism.

At B1 H32 K = V = 128 bf16 (``bench_chunk.inputs``: l2norm in the kernel, ``g = logsigmoid(randn)`` in fp32, seed 1
at T = 1000 and seed 2 at T = 32768, the seeds of ``bench_chunk.py``) and the cotangents of ``bench_chunk_bwd.py``
(``do``, ``dht`` from seed 9): the relative error ``||x - ref|| / ||ref||`` of ``o``, the final state and the five
gradients, for kda-ops and fla-core on the same inputs. The oracles are ``reference.chunk_fwd`` and
``reference.chunk_bwd`` in float64, run on the GPU per group of heads (their pairwise decays are ``[.., 64, 64, K]``
per chunk). Then ``--runs`` forward + backward calls at the longest length, compared bit for bit.

Usage: ``python benchmarks/chunk_errors.py [--lengths T ...] [--runs N] [--fla-configs N] [--skip-fla] [--out DIR]``;
needs a CUDA GPU (about a minute on an H100 with ``--fla-configs 2``: fla's backward otherwise autotunes every
config of every kernel at each new shape, see ``peer_errors.py``).
"""

from __future__ import annotations

import argparse
import glob
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_chunk  # noqa: E402
import bench_chunk_bwd  # noqa: E402
import peer_errors  # noqa: E402
import torch  # noqa: E402

import kda_ops  # noqa: E402
from kda_ops import reference  # noqa: E402
from kda_ops.common import Options  # noqa: E402
from kda_ops.testing import rel_err  # noqa: E402

H, D = 32, bench_chunk.D
SEEDS = {1000: 1, 32768: 2}
COLUMNS = ("o", "final state", *("d" + n for n in bench_chunk_bwd.GRADS))


def cotangents(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``do [1, T, H, D]`` (bf16) and ``dht [1, H, D, D]`` (fp32), as ``bench_chunk_bwd.py`` draws them."""
    gen = torch.Generator(device=bench_chunk.DEV).manual_seed(9)
    do = torch.randn(1, T, H, D, generator=gen, device=bench_chunk.DEV).bfloat16()
    return do, torch.randn(1, H, D, D, generator=gen, device=bench_chunk.DEV)


def grad_oracle(x: dict[str, torch.Tensor], do: torch.Tensor, dht: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """The float64 gradients of q, k, v, g, beta, ``heads`` heads at a time."""
    parts: list[list[torch.Tensor]] = [[] for _ in bench_chunk_bwd.GRADS]
    for h in range(0, H, heads):
        d = {n: t[:, :, h : h + heads].double() for n, t in x.items()}
        grads = reference.chunk_bwd(do[:, :, h : h + heads].double(), dht[:, h : h + heads].double(),
                                    *(d[n] for n in bench_chunk_bwd.GRADS), D**-0.5, None, None, None, None,
                                    Options(use_qk_l2norm=True))  # fmt: skip
        for part, g in zip(parts, grads):
            part.append(g)
    return [torch.cat(part, dim=2) for part in parts]


def error_rows(T: int, impls: dict[str, Callable[..., Any]]) -> list[str]:
    """One markdown row per implementation at length ``T``: the relative error of each of :data:`COLUMNS`."""
    x = bench_chunk.inputs(1, T, H, seed=SEEDS.get(T, 0))
    do, dht = cotangents(T)
    ref_o, ref_s = bench_chunk.oracle(x, heads=4 if T <= 4096 else 2)
    ref_g = grad_oracle(x, do, dht, heads=4 if T <= 4096 else 2)
    rows = []
    for name, fn in impls.items():
        with torch.no_grad():
            o, s = fn(**x, use_qk_l2norm_in_kernel=True, output_final_state=True)
        grads = bench_chunk_bwd.grad_errors(fn, x, do, dht, tuple(ref_g))
        errs = [rel_err(o, ref_o), rel_err(s, ref_s), *grads.values()]
        rows.append(f"| {T} | {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def deterministic(T: int, runs: int) -> bool:
    """Whether ``runs`` forward + backward calls give ``o``, the final state and every gradient bit for bit."""
    x = bench_chunk.inputs(1, T, H, seed=SEEDS.get(T, 0))
    do, dht = cotangents(T)
    step = bench_chunk_bwd.fwd_bwd(kda_ops.chunk_kda, x, do, dht)
    outs = []
    for _ in range(runs):
        with torch.no_grad():
            o, s = kda_ops.chunk_kda(**x, use_qk_l2norm_in_kernel=True, output_final_state=True)
        outs.append([o.clone(), s.clone(), *(g.clone() for g in step() if g is not None)])
    return all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--lengths", type=int, nargs="+", default=sorted(SEEDS), help="sequence lengths T")
    ap.add_argument("--runs", type=int, default=3, help="forward + backward calls compared bit for bit")
    ap.add_argument("--fla-configs", type=int, default=None,
                    help="keep each of fla's autotuned kernels to its N configs of least shared memory")  # fmt: skip
    ap.add_argument("--skip-fla", action="store_true", help="ours and the oracle only")
    ap.add_argument("--wheels", nargs="*", default=sorted(glob.glob(str(ROOT / ".whl" / "*.whl"))))
    ap.add_argument("--out", type=Path, default=None, help="also write the table to DIR/chunk_errors.md")
    args = ap.parse_args()
    if args.fla_configs is not None and args.fla_configs < 1:
        ap.error("--fla-configs: expected at least 1")
    if min(args.lengths) < 1:
        ap.error("--lengths: expected positive sequence lengths")
    if args.runs < 2:
        ap.error("--runs: expected at least 2")
    if not torch.cuda.is_available():
        print("chunk_errors.py needs a CUDA GPU", file=sys.stderr)
        return 1
    fla_fn, where = (None, "fla skipped") if args.skip_fla else bench_chunk.load_fla(args.wheels)
    if fla_fn is not None and args.fla_configs is not None:
        limited = peer_errors.limit_fla_autotune(args.fla_configs)
        where += f", autotune limited to {args.fla_configs} configs in {limited} kernels"
    impls: dict[str, Callable[..., Any]] = {"ours": kda_ops.chunk_kda, **({"fla": fla_fn} if fla_fn else {})}
    lines = [f"Errors against float64, B1 H{H} K = V = {D} bf16, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, {where}", "", "| T | impl | " + " | ".join(COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]  # fmt: skip
    for T in args.lengths:
        lines += error_rows(T, impls)
        torch.cuda.empty_cache()
    T = max(args.lengths)
    lines += ["", f"{args.runs} forward + backward calls at T = {T} bit for bit equal: {deterministic(T, args.runs)}"]
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chunk_errors.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
