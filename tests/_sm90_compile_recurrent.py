"""Compile the recurrent kernels for sm_90 without a GPU: ``python tests/_sm90_compile_recurrent.py``.

Like ``tests/_sm90_compile.py`` (whose ``build`` and ``resources`` it uses): one JSON line per variant with
registers, spill stack and shared memory, or the compile error, at the launch configuration the launchers use.
Run with ``TRITON_INTERPRET`` unset; ``tests/test_triton_recurrent_compile.py`` runs it in a subprocess.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from _sm90_compile import build, resources  # noqa: E402

from kda_ops.triton.recurrent import launch_config, recurrent_fwd_kernel  # noqa: E402
from kda_ops.triton.recurrent_bwd import backward_config, recurrent_bwd_kernel  # noqa: E402

STAGES = int(os.environ.get("STAGES", "3"))  # triton's default: the launchers do not set num_stages
BF, F16, F32, F64, I32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64
ALL = dict(USE_L2NORM=True, USE_GATE=True, HAS_A_LOG=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=False,
           USE_BETA_SIGMOID=True, NEG_EIGVAL=True)  # fmt: skip
PLAIN = dict(USE_L2NORM=False, USE_GATE=False, HAS_A_LOG=False, HAS_DT_BIAS=False, USE_LOWER_BOUND=False,
             USE_BETA_SIGMOID=False, NEG_EIGVAL=False)  # fmt: skip
BOUND = dict(PLAIN, USE_GATE=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=True)  # lower bound, no A_log


def forward(K: int, V: int, x: torch.dtype, opts: dict[str, bool], *, serving: bool = False, varlen: bool = False,
            state: bool = True) -> tuple[Any, dict[str, Any], int]:  # fmt: skip
    BK, BV, warps = launch_config(K, V)
    s = F64 if x == F64 else F32
    args = dict(q=x, k=x, v=x, g=s, beta=x, o=x, h0=s if state else None, ht=s if state else None,
                cu_seqlens=I32 if varlen else None, state_indices=I32 if serving else None,
                A_log=F32 if opts["HAS_A_LOG"] else None, dt_bias=F32 if opts["HAS_DT_BIAS"] else None,
                scale=0.1, lower_bound=-5.0, T=7, NS=9, H=8, HV=32, K=K, V=V, BK=BK, BV=BV,
                DT=tl.float64 if x == F64 else tl.float32, **opts, USE_INITIAL_STATE=state, STORE_FINAL_STATE=state,
                IS_VARLEN=varlen, USE_STATE_INDICES=serving)  # fmt: skip
    return recurrent_fwd_kernel, args, warps


def backward(K: int, V: int, x: torch.dtype, opts: dict[str, bool], *, varlen: bool = False,
             state: bool = True) -> tuple[Any, dict[str, Any], int]:  # fmt: skip
    BK, BV, warps = backward_config(K, V)
    s = F64 if x == F64 else F32
    args = dict(q=x, k=x, v=x, g=s, beta=x, do=x, dht=s if state else None, h0=s if state else None, dq=s, dk=s,
                dv=x, dg=s, dbeta=s, dh0=s if state else None, dA=s if opts["HAS_A_LOG"] else None,
                ddt=s if opts["HAS_DT_BIAS"] else None, ckpt=s, scratch=s, cu_seqlens=I64 if varlen else None,
                A_log=F32 if opts["HAS_A_LOG"] else None, dt_bias=F32 if opts["HAS_DT_BIAS"] else None,
                scale=0.1, lower_bound=-5.0, T=7, TOT=7, N=3, C=8, H=8, HV=32, K=K, V=V, BK=BK, BV=BV,
                DT=tl.float64 if x == F64 else tl.float32, **opts, USE_INITIAL_STATE=state,
                USE_FINAL_STATE_GRADIENT=state, IS_VARLEN=varlen)  # fmt: skip
    return recurrent_bwd_kernel, args, warps


# "decode ..." variants are the performance-critical ones: the test requires them not to spill.
VARIANTS = {
    "decode serving bf16 K=V=128 all options": forward(128, 128, BF, ALL, serving=True),
    "decode serving bf16 K=V=128 plain varlen": forward(128, 128, BF, PLAIN, serving=True, varlen=True),
    "decode recurrent bf16 K=V=128 l2norm": forward(128, 128, BF, dict(PLAIN, USE_L2NORM=True)),
    "forward fp32 K=100 V=72 lower bound varlen": forward(100, 72, F32, BOUND, varlen=True),
    "forward bf16 K=V=256 all options": forward(256, 256, BF, ALL),
    "forward fp16 K=V=16 no state": forward(16, 16, F16, PLAIN, state=False),
    "forward fp64 K=V=64 all options": forward(64, 64, F64, ALL),
    "backward bf16 K=V=128 all options varlen": backward(128, 128, BF, ALL, varlen=True),
    "backward fp32 K=V=128 plain no state": backward(128, 128, F32, PLAIN, state=False),
    "backward bf16 K=100 V=72 lower bound": backward(100, 72, BF, BOUND),
    "backward bf16 K=V=256 all options": backward(256, 256, BF, ALL),
    "backward fp64 K=V=64 all options": backward(64, 64, F64, ALL),
}


def main() -> int:
    failures = 0
    for name, (kernel, args, warps) in VARIANTS.items():
        try:
            info: dict[str, Any] = {"variant": name, "ok": True, "num_warps": warps, "BV": args["BV"],
                                    **resources(build(kernel, args, warps, STAGES))}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - reported per variant; the exit status says whether any failed
            failures += 1
            info = {"variant": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}
        print(json.dumps(info), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
