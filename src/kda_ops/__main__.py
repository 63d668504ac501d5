"""``python -m kda_ops``: versions, device, and both public functions checked against the float64 oracle.

Runs :func:`kda_ops.chunk_kda` and :func:`kda_ops.recurrent_kda` on a small random problem on the device present
(the first CUDA device, else the CPU), compares output and final state with
:func:`kda_ops.reference.naive_recurrent_kda` in float64, runs one ``torch.compile(fullgraph=True)`` call of
``chunk_kda``, and prints a table of relative errors and times per call. Exit status 1 when an op fails or its
error exceeds the tolerance; a compile that cannot run here (no C++ compiler for Inductor on the CPU, say) is
reported in its row and does not fail the run.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import kda_ops
from kda_ops.api import MAX_HEAD_DIM
from kda_ops.reference import naive_recurrent_kda
from kda_ops.testing import make_inputs, make_state, rel_err

# Far above the error of a correct fp32 kernel (~1e-6 here), far below that of a wrong one (~1).
_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass
class Row:
    op: str
    err_o: float | None = None
    err_state: float | None = None
    ms: float | None = None
    note: str = ""


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return str(triton.__version__)


def _device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        return torch.device("cuda"), f"cuda: {torch.cuda.get_device_name(0)}"
    return torch.device("cpu"), f"cpu: {platform.processor() or platform.machine()}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    fn()  # warm-up: autotuning, compilation, caches
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def _check(
    name: str,
    fn: Callable[..., tuple[Tensor, Tensor | None]],
    args: dict[str, Any],
    ref: tuple[Tensor, Tensor],
    device: torch.device,
    iters: int,
    tol: float,
) -> tuple[Row, bool]:
    """One table row; the bool says whether the op ran and its errors are within ``tol``."""
    try:
        o, state = fn(**args)
        assert state is not None
        row = Row(name, rel_err(o, ref[0]), rel_err(state, ref[1]))
        row.ms = _time_ms(lambda: fn(**args), device, iters)
    except Exception as e:  # a table row, not a traceback: report and go on to the next op
        msg = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        return Row(name, note=f"failed: {type(e).__name__}: {msg}"), False
    assert row.err_o is not None and row.err_state is not None
    ok = row.err_o <= tol and row.err_state <= tol
    if not ok:
        row.note = f"error above {tol:.0e}"
    return row, ok


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _check_sizes(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse sizes outside the public functions' contract by their flag (argparse's message, exit status 2)."""
    for flag, value, low, high in (
        ("--B", a.B, 0, None), ("--T", a.T, 0, None), ("--H", a.H, 1, None), ("--K", a.K, 1, MAX_HEAD_DIM),
        ("--V", a.V, 1, MAX_HEAD_DIM), ("--iters", a.iters, 1, None),
    ):  # fmt: skip
        if value < low or (high is not None and value > high):
            p.error(f"{flag}: expected {f'a value in [{low}, {high}]' if high else f'at least {low}'}, got {value}")
    if a.HV < 1 or a.HV % a.H:
        p.error(f"--HV: expected a multiple of --H = {a.H} (value heads share q/k heads), got {a.HV}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kda_ops", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--HV", type=int, default=4, help="value heads, a multiple of H")
    p.add_argument("--K", type=int, default=32)
    p.add_argument("--V", type=int, default=32)
    p.add_argument("--iters", type=int, default=5, help="timed calls per op")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    a = p.parse_args(argv)
    _check_sizes(p, a)
    dtype: torch.dtype = getattr(torch, a.dtype)

    device, device_name = _device()
    print(f"kda_ops  {kda_ops.__version__}")
    print(f"torch    {torch.__version__}")
    print(f"triton   {_triton_version()}")
    print(f"python   {platform.python_version()}")
    print(f"device   {device_name}")
    empty = " (no tokens: the rows check shapes and final states only)" if a.B * a.T == 0 else ""
    print(f"problem  B={a.B} T={a.T} H={a.H} HV={a.HV} K={a.K} V={a.V} {a.dtype}, initial state, l2norm on q/k{empty}")
    print()

    x = make_inputs(a.B, a.T, a.H, a.K, a.V, HV=a.HV, dtype=dtype, device=device)
    h0 = make_state(a.B, a.HV, a.K, a.V, device=device)
    kw: dict[str, Any] = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    args = {**x, **kw}
    ref_args = {name: t.detach().cpu().double() for name, t in args.items() if isinstance(t, Tensor)}
    ref_o, ref_state = naive_recurrent_kda(**{**kw, **ref_args})
    assert ref_state is not None
    ref = (ref_o, ref_state)
    tol = _TOL[dtype]

    rows: list[Row] = []
    ok = True
    for name, fn in (("chunk_kda", kda_ops.chunk_kda), ("recurrent_kda", kda_ops.recurrent_kda)):
        row, good = _check(name, fn, args, ref, device, a.iters, tol)
        rows.append(row)
        ok &= good

    if not a.no_compile:
        torch._dynamo.reset()
        compiled = torch.compile(kda_ops.chunk_kda, fullgraph=True)
        name = "chunk_kda compiled"
        t0 = time.perf_counter()
        try:
            compiled(**args)
            _sync(device)
        except Exception as e:  # no C++ compiler for Inductor, say: report it, the eager rows stand
            msg = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
            rows.append(Row(name, note=f"compile failed: {type(e).__name__}: {msg}"))
        else:
            compile_s = time.perf_counter() - t0
            row, good = _check(name, compiled, args, ref, device, a.iters, tol)
            row.note = row.note or f"fullgraph=True, compiled in {compile_s:.1f} s"
            rows.append(row)
            ok &= good

    head = f"{'op':<20} {'rel err o':>10} {'rel err state':>14} {'ms/call':>9}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        errs = f"{_fmt(r.err_o, '10.2e'):>10} {_fmt(r.err_state, '14.2e'):>14}"
        print(f"{r.op:<20} {errs} {_fmt(r.ms, '9.3f'):>9}  {r.note}")
    print()
    print(f"tolerance {tol:.0e} (relative to the float64 naive recurrence): {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
