"""Errors of kda-ops and fla-core against the float64 recurrence, on the same inputs, in one process.

The cases a new user hit in 16-bit (``docs/benchmarks.md``, "Errors against fla-core"):

- ``gate fp16`` / ``gate bf16``: packed ``cu_seqlens = [0, 256, 500, 1000]``, H = HV = 4, K = V = 64, the gate in
  the kernel on a raw ``g = randn`` with 90 % of its entries -1000, ``A_log = log U(1, 16)``, ``dt_bias = randn``,
  k l2-normalised outside (q not), ``beta = sigmoid(rand)``, ``h0 = randn`` (fp32): the gradients of ``A_log`` and
  ``dt_bias`` sum many small terms with cancellation.
- ``short fp16``: B1 T63 H1 K = V = 64 fp16, no l2norm (keys ``randn / 8``), ``g = logsigmoid(randn)``: the
  forward alone.
- ``K256 <dtype> <dense|packed>``: B1 T4096 H4 K = V = 256, l2norm in the kernel, ``g = logsigmoid(randn)``, the
  packed row ``[0, 100, 300, 1200, 3000, 4096]``.

Both libraries are called through the same signature (``kda_ops.compat.fla.chunk_kda`` is fla's), the gradients by
autograd with the same cotangents; the oracle is autograd of ``kda_ops.reference.naive_recurrent_kda`` on float64
copies of the 16-bit inputs. The figure is the relative error ``||x - ref|| / ||ref||`` (fla's RMS error ratio).

Usage: ``python benchmarks/peer_errors.py [--out DIR] [--wheels WHEEL ...] [--skip-fla] [--cases NAME ...]
[--fla-configs N]``; needs a CUDA GPU. fla's backward autotunes at each new shape over every config of each kernel
(more than 200 s for the first case on an H200): ``--fla-configs N`` keeps each of its autotuned kernels to the N
configs of least shared memory (fewest stages, smallest tiles), which compiles in seconds; the tile choice changes
only the order of a kernel's sums, not what it computes.
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

import _bench  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kda_ops.compat import fla as ours  # noqa: E402
from kda_ops.reference import naive_recurrent_kda  # noqa: E402
from kda_ops.testing import gate_reset_row, rel_err  # noqa: E402

DEV = "cuda"
F16, BF16, F64 = torch.float16, torch.bfloat16, torch.float64
Case = tuple[dict[str, torch.Tensor], dict[str, Any], bool]  # (leaves, other keywords, backward too)


def gate_case(dtype: torch.dtype) -> Case:
    leaves, kw = gate_reset_row(4, dtype, DEV)
    return leaves, kw, True


def short_case() -> Case:
    gen = torch.Generator().manual_seed(0)
    x = {n: torch.randn(1, 63, 1, 64, generator=gen) for n in ("q", "k", "v")}
    x["k"] = x["k"] / 8  # keys of norm ~1: a stable delta rule without the l2norm
    x["g"] = F.logsigmoid(torch.randn(1, 63, 1, 64, generator=gen))
    x["beta"] = torch.rand(1, 63, 1, generator=gen)
    return {n: t.to(DEV, F16) for n, t in x.items()}, {"output_final_state": True}, False


def k256_case(dtype: torch.dtype, packed: bool) -> Case:
    gen = torch.Generator().manual_seed(3)
    x = {n: torch.randn(1, 4096, 4, 256, generator=gen) for n in ("q", "k", "v")}
    x["g"] = F.logsigmoid(torch.randn(1, 4096, 4, 256, generator=gen))
    x["beta"] = torch.rand(1, 4096, 4, generator=gen)
    kw: dict[str, Any] = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 100, 300, 1200, 3000, 4096], device=DEV, dtype=torch.int32)
    return {n: t.to(DEV, dtype) for n, t in x.items()}, kw, True


def cases() -> dict[str, Case]:
    out = {"gate fp16": gate_case(F16), "gate bf16": gate_case(BF16), "short fp16": short_case()}
    for dtype, name in ((F16, "fp16"), (BF16, "bf16")):
        for packed in (False, True):
            out[f"K256 {name} {'packed' if packed else 'dense'}"] = k256_case(dtype, packed)
    return out


def limit_fla_autotune(n: int) -> int:
    """Keep every autotuned kernel of the imported ``fla`` modules to its ``n`` configs of least shared memory (fewest
    pipeline stages, then the smallest product of the tile sizes); the number of kernels limited."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    def cost(c: Any) -> tuple[int, int, int]:
        tiles = 1
        for v in c.kwargs.values():
            tiles *= v if isinstance(v, int) and not isinstance(v, bool) else 1
        return (c.num_stages or 0, tiles, c.num_warps or 0)

    limited = 0
    for name, mod in list(sys.modules.items()):
        if not (name == "fla" or name.startswith("fla.")):
            continue
        for obj in list(vars(mod).values()):
            while isinstance(obj, KernelInterface):  # through the heuristics wrapped around an autotuner
                if isinstance(obj, Autotuner) and len(obj.configs) > n:
                    obj.configs = sorted(obj.configs, key=cost)[:n]
                    limited += 1
                obj = getattr(obj, "fn", None)
    return limited


def run(fn: Callable[..., Any], leaves: dict[str, torch.Tensor], kw: dict[str, Any], grad: bool,
        cot: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor]:  # fmt: skip
    """``o``, the final state and (with ``grad``) every leaf's gradient of ``fn`` called on copies of ``leaves``."""
    xs = {n: t.detach().clone().requires_grad_(grad) for n, t in leaves.items()}
    o, s = fn(**xs, **kw)
    out = {"o": o.detach(), "state": s.detach()}
    if grad:
        assert cot is not None
        torch.autograd.backward((o, s), (cot[0].to(o.dtype), cot[1].to(s.dtype)))
        out.update({"d" + n: t.grad for n, t in xs.items() if t.grad is not None})
    return out


def compare(fla_fn: Callable[..., Any] | None, only: list[str] | None = None) -> list[str]:
    lines = []
    for name, (leaves, kw, grad) in cases().items():
        if only and not any(name.startswith(o) for o in only):
            continue
        gen = torch.Generator(device=DEV).manual_seed(9)
        N = kw["cu_seqlens"].numel() - 1 if "cu_seqlens" in kw else leaves["q"].shape[0]
        H, K, V = leaves["q"].shape[2], leaves["q"].shape[3], leaves["v"].shape[3]
        cot = (torch.randn(leaves["v"].shape, generator=gen, device=DEV), torch.randn(N, H, K, V, generator=gen,
                                                                                        device=DEV))  # fmt: skip
        print(f"{name}: oracle", file=sys.stderr, flush=True)
        ref = run(naive_recurrent_kda, {n: t.to(F64) for n, t in leaves.items()}, kw, grad, cot)
        print(f"{name}: kda-ops", file=sys.stderr, flush=True)
        got = {"ours": run(ours.chunk_kda, leaves, kw, grad, cot)}
        if fla_fn is not None:
            print(f"{name}: fla", file=sys.stderr, flush=True)
            try:
                got["fla"] = run(fla_fn, leaves, kw, grad, cot)
            except Exception as e:  # noqa: BLE001 - the peer's failure is a row of the table
                print(f"{name}: fla failed: {type(e).__name__}: {e}", file=sys.stderr)
        names = list(ref)
        lines += ["", f"{name}:", "", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for who, out in got.items():
            errs = [f"{rel_err(out[n], ref[n]):.2e}" if n in out else "-" for n in names]
            lines.append(f"| {who} | " + " | ".join(errs) + " |")
        print("\n".join(lines[-2 - len(got) :]), flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--wheels",
        nargs="*",
        default=sorted(glob.glob(str(ROOT / ".whl" / "*.whl"))),
        help="fla-core and einops wheels to import fla from when it is not installed",
    )
    parser.add_argument("--skip-fla", action="store_true", help="ours and the oracle only")
    parser.add_argument("--cases", nargs="*", default=None,
                        help="only the cases whose names start so (gate, short, K256; fla autotunes per case)")
    parser.add_argument("--fla-configs", type=int, default=None,
                        help="keep each of fla's autotuned kernels to its N configs of least shared memory")
    args = parser.parse_args()
    if args.fla_configs is not None and args.fla_configs < 1:
        parser.error("--fla-configs: expected at least 1")
    if not torch.cuda.is_available():
        print("peer_errors.py needs a CUDA GPU", file=sys.stderr)
        return 1
    fla_fn, where = (None, "fla skipped") if args.skip_fla else _bench.load_fla(args.wheels, "chunk_kda")
    if fla_fn is not None and args.fla_configs is not None:
        where += f", autotune limited to {args.fla_configs} configs in {limit_fla_autotune(args.fla_configs)} kernels"
    lines = [f"# Errors against float64, {torch.cuda.get_device_name()}, torch {torch.__version__}, {where}",
             *compare(fla_fn, args.cases)]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer_errors.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
