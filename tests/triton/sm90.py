"""Compile the Triton kernels for an H100/H200 (sm_90) without a GPU: ``python -m tests.triton.sm90 [SOURCE ...]
[NAME=VALUE ...]`` (the overrides probe a launch or a kernel form: :func:`main`).

The interpreter runs the kernels' semantics on the CPU but never lowers them to the GPU; a kernel that interprets
fine can still fail to compile for sm_90 (layouts, dot shapes, loop-carried types). This script builds each kernel
ahead of time with triton's bundled ptxas for ``cuda:90`` and prints one JSON line per variant (registers, spill
stack, shared memory, or the compile error). Run it with ``TRITON_INTERPRET`` unset: under the interpreter
``@triton.jit`` returns interpreted functions that cannot be compiled.

Every variant belongs to the source module of the kernel it compiles (``SOURCE``: ``chunk.prepare``, ...,
``recurrent.forward``; the test-only stage kernels of ``tests/triton/chunk/stage_kernels.py`` count for the module
whose device helpers they run); the test file of that module runs its variants through :func:`check_compiles`, in
a subprocess. The chunk backward's kernels are taken as its driver launches them (:func:`backward_launches`) and
must not spill more than :data:`BACKWARD_MAX_STACK` bytes per thread; the recurrent decode variants must not spill.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BF, F16, F32, F64, I64, I32 = torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32
PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64",
       torch.int64: "*i64", torch.int32: "*i32", torch.int8: "*i8"}  # fmt: skip

# Constexprs that every variant takes as an H200 launch does: the forward's kernels open with pdl_enter; the scans
# read the user's states, not a pool's slots, and the output stage writes every slot, unless a variant says so.
DEFAULTS: dict[str, Any] = {"PDL": True, "USE_SLOTS": False, "USE_CKPT": False, "KEEP": False}

# Spill bound of the chunk backward's kernels (bytes of local stack per thread): the dq/dk stage spilled 3 KB before
# its diagonal blocks went column by column, the dv stage 552 B at 64-wide tiles, the recompute's exact-fp32 solve
# 816 B. Register allocation differs between Triton versions: with 3.7 the largest is 80 B (dv), with 3.9 the
# reverse scan spills 168 B.
BACKWARD_MAX_STACK = 256
# At K = V = 256 (the "K=V=256" sets) the scans hold [256, BV] tiles of three factors: up to 504 B with triton 3.6, 840
# B with 3.9 (16 warps, half the registers, spill more); there the check is the shared memory's.
BACKWARD_MAX_STACK_256 = 1024
# The split scans at 4 warps (the "split" set): 40-48 B with triton 3.6, 336 B with 3.9.
BACKWARD_MAX_STACK_SPLIT = 512
# Shared memory of one program on an H200 (bytes): a kernel asking for more fails at launch (OutOfResources).
SHARED_LIMIT = 232448

# The sources whose test files compile their variants (check_compiles): every variant must belong to one.
SOURCES = (
    "chunk.decays",
    "chunk.intra",
    "chunk.solve",
    "chunk.prepare",
    "chunk.scan",
    "chunk.output",
    "chunk.slots",
    "chunk.l2norm",
    "chunk.scan_bwd",
    "chunk.dv",
    "chunk.dqk",
    "recurrent.forward",
    "recurrent.backward",
)

Variant = tuple[str, Any, dict[str, Any], int, int]  # (source, kernel, arguments, num_warps, num_stages)


def jit_function(kernel: Any) -> Any:
    import triton

    fn = kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = fn.fn  # through @triton.autotune
    return fn


def build(kernel: Any, args: dict[str, Any], num_warps: int, num_stages: int = 1) -> Any:
    """Compile ``kernel`` for sm_90 with ``args``: a torch dtype for a pointer, None, an int, a float, or a constexpr
    value; pointers and ints divisible by 16 get the alignment hints a launch would give them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(kernel)
    constexpr = {fn.arg_names[i] for i, p in enumerate(fn.params) if p.is_constexpr}
    sig: dict[str, str] = {}
    const: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(fn.arg_names):
        v = args[name] if name in args else DEFAULTS[name]
        param = fn.params[i]  # arguments a launch does not specialise get no hint here either (jit_any_length)
        if isinstance(v, torch.dtype):
            sig[name] = PTR[v]
            if not param.do_not_specialize_on_alignment:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif v is None or name in constexpr:
            sig[name] = "constexpr"
            const[name] = v
        elif isinstance(v, int):
            sig[name] = "i32"
            if v % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})  # fmt: skip


def resources(compiled: Any) -> dict[str, Any]:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = {"shared": compiled.metadata.shared}
    if cuobjdump.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                  text=True).stdout  # fmt: skip
        m = re.search(r"REG:(\d+) STACK:(\d+)", text)
        if m:
            out.update(registers=int(m.group(1)), stack=int(m.group(2)))
    return out


# ------------------------------------------------------------------------------------------ chunk kernels


def chunk_variants() -> dict[str, Variant]:
    import triton
    import triton.language as tl

    from kda_ops.triton.chunk import decays, output, prepare, scan, slots
    from tests.triton.chunk import stage_kernels

    def prep(blocks: bool, K: int = 128, V: int = 128, x: torch.dtype = BF, store: torch.dtype = BF,
             prec: tuple[str, str, str] = ("tf32", "tf32", "tf32"), dt: Any = tl.float32,
             gate: bool = False, fold: bool = False) -> dict[str, Any]:  # fmt: skip
        a = dict(q=x, k=x, v=x, g=F32, beta=x, A_log=F32 if gate else None, dt_bias=F32 if gate else None,
                 Mqk=store, W=store, U=None, Qt=store, Kend=store,
                 Gl=F32 if dt == tl.float32 else F64, Tm=None,
                 Flag=I32, Nrm=F32 if fold else None, Rqk=None, T=1000,
                 slot_start=I64, slot_count=I64, scale=0.1, lower_bound=0.0, H=2, HV=32, K=K, V=V,
                 BK=32 if blocks else 64, BV=min(V, 64), NB=4, BC=16, BT=64, USE_L2NORM=True, USE_GATE=gate,
                 HAS_A_LOG=gate, HAS_DT_BIAS=gate, USE_LOWER_BOUND=False, USE_BETA_SIGMOID=gate, NEG_EIGVAL=gate,
                 PREC_INTRA=prec[0], PREC_SOLVE=prec[1], PREC_WY=prec[2], DT=dt, STORE_TM=False)  # fmt: skip
        flags = {"NI": 4096, "FB": prepare.FLAG_BLOCK, "FLAG_LOOP": True}
        a.update({"SPAN": 80.0, "CHECK_FLAG": True, **flags} if blocks
                 else {"ASPAN": 80.0, "PREFETCH": fold, "Sums": F32 if dt == tl.float32 else F64, "GIVEN_SUMS": True})
        a["FOLD"] = fold
        a["GIVEN_NORMS"] = False
        return a

    def scn(K: int, V: int, BV: int, store: torch.dtype = BF, prec: str = "bf16", norms: bool = False,
            x_form: bool = False, phase: int = 0, v_first: bool = False) -> dict[str, Any]:  # fmt: skip
        return dict(W=store, U=store, Kend=store, Gl=F32, h0=F32, final=F32, Hin=store,
                    E=store, Nk=F32 if norms else None, cu=I64, chunk_off=I64, MB=F32 if phase == 1 else None,
                    Slots=None, NSLOT=0, Ckpt=None, NCKPT=0, CKPT_EVERY=0, HV=32,
                    T=1000, NSEG=1 if phase == 0 else 7, K=K, V=V,
                    BK=max(16, triton.next_power_of_2(K)), BV=BV, BT=64, USE_INITIAL_STATE=True,
                    STORE_FINAL_STATE=True, PREC_SCAN=prec, DT=tl.float32, NORMS=norms, X_FORM=x_form,
                    PHASE=phase, STATE_V_FIRST=v_first)  # fmt: skip

    def seg(K: int, V: int, v_first: bool = False) -> dict[str, Any]:
        return dict(MB=F32, h0=F32, Sin=F32, Slots=None, NSLOT=0, cu=I64,
                    HV=32, NSEG=7, BT=64, K=K, V=V, BK=K, BV=16, BKC=K if K <= 128 else 32, USE_INITIAL_STATE=True,
                    PREC="tf32x3" if K <= 128 else "ieee", DT=tl.float32, STATE_V_FIRST=v_first,
                    REVERSE=False)  # fmt: skip

    stage = dict(slot_start=I64, slot_count=I64, lower_bound=0.0, HV=32, BT=64, USE_GATE=True, HAS_A_LOG=True,
                 HAS_DT_BIAS=True, USE_LOWER_BOUND=False, DT=tl.float32)  # fmt: skip
    qk = dict(H=2, NB=4, BC=16, USE_L2NORM=True, USE_BETA_SIGMOID=True, NEG_EIGVAL=False)
    anchored, blocks = prepare.chunk_prepare_kernel, prepare.chunk_prepare_blocks_kernel
    return {
        "prepare anchored bf16 K=V=128": ("chunk.prepare", anchored, prep(False), 8, 1),
        "prepare anchored bf16 K=V=128 folded l2norm": ("chunk.prepare", anchored, prep(False, fold=True), 8, 1),
        "prepare blocks bf16 K=V=128 folded l2norm": ("chunk.prepare", blocks, prep(True, fold=True), 8, 1),
        "prepare anchored bf16 K=V=128 folded l2norm, as launched": ("chunk.prepare", anchored,
                                                                      dict(prep(False, fold=True), BK=32), 4, 1),
        "prepare anchored fp16 K=V=128 folded l2norm, as launched": ("chunk.prepare", anchored,
            dict(prep(False, x=F16, store=F16, prec=("tf32x3", "tf32rn", "tf32rn"), fold=True), BK=32), 4, 1),
        "scan bf16 K=V=128 BV=32 norms": ("chunk.scan", scan.chunk_state_kernel, scn(128, 128, 32, norms=True), 8, 1),
        "scan bf16 K=V=128 BV=32 norms X form": ("chunk.scan", scan.chunk_state_kernel,
                                                 scn(128, 128, 32, norms=True, x_form=True), 8, 1),
        **{f"split scan pass {ph} bf16 K=V=128 BV=32 norms X form": ("chunk.scan", scan.chunk_state_kernel,
           scn(128, 128, 32, norms=True, x_form=True, phase=ph), 4, 1) for ph in (1, 2)},
        "split scan pass 1 bf16 K=V=128 BV=32 E form": ("chunk.scan", scan.chunk_state_kernel,
                                                        scn(128, 128, 32, phase=1), 4, 1),
        **{f"segment states fp32 K=V={K}": ("chunk.scan", scan.segment_states_kernel, seg(K, K), 8, 1)
           for K in (128, 256)},
        "scan bf16 K=V=128 BV=32 norms X form V-first": ("chunk.scan", scan.chunk_state_kernel,
                                                         scn(128, 128, 32, norms=True, x_form=True, v_first=True), 8,
                                                         1),
        "split scan pass 2 bf16 K=V=128 BV=32 norms X form V-first": ("chunk.scan", scan.chunk_state_kernel,
            scn(128, 128, 32, norms=True, x_form=True, phase=2, v_first=True), 4, 1),
        "segment states fp32 K=V=128 V-first": ("chunk.scan", scan.segment_states_kernel, seg(128, 128, True), 8, 1),
        "scan bf16 K=V=128 BV=32 norms X form, pool slots and checkpoints": ("chunk.scan", scan.chunk_state_kernel,
            dict(scn(128, 128, 32, norms=True, x_form=True), Slots=I64, NSLOT=9, USE_SLOTS=True, Ckpt=I64, NCKPT=3,
                 CKPT_EVERY=128, USE_CKPT=True), 8, 1),
        "split scan pass 2 bf16 K=V=128 BV=32 norms X form, pool slots and checkpoints": (
            "chunk.scan", scan.chunk_state_kernel,
            dict(scn(128, 128, 32, norms=True, x_form=True, phase=2), Slots=I64, NSLOT=9, USE_SLOTS=True, Ckpt=I64,
                 NCKPT=3, CKPT_EVERY=128, USE_CKPT=True), 4, 1),
        "segment states fp32 K=V=128, pool slots": ("chunk.scan", scan.segment_states_kernel,
            dict(seg(128, 128), Slots=I64, NSLOT=9, USE_SLOTS=True), 8, 1),
        **{f"output norms bf16 K=V={K} BV={bv}": ("chunk.output", output.chunk_output_kernel, dict(Qt=BF, Mqk=BF,
           Hin=BF, E=BF, o=BF, Nq=F32, slot_start=I64, slot_count=I64, Keep=None, NC=17, HV=32, T=1000, K=K, V=K,
           BK=K, BV=bv, BT=64, PREC="bf16", DT=tl.float32, NORMS=True, STAGES=st), 4, st)
           for K, bv, st in ((128, 128, 3), (256, 64, 1))},
        "output norms bf16 K=V=128 BV=128, padding sequences": ("chunk.output", output.chunk_output_kernel,
            dict(Qt=BF, Mqk=BF, Hin=BF, E=BF, o=BF, Nq=F32, slot_start=I64, slot_count=I64, Keep=I32, NC=17, HV=32,
                 T=1000, K=128, V=128, BK=128, BV=128, BT=64, PREC="bf16", DT=tl.float32, NORMS=True, STAGES=3,
                 KEEP=True), 4, 3),
        "prepare anchored fp32 K=V=100": ("chunk.prepare", anchored,
                                          prep(False, 100, 100, F32, F32, ("ieee",) * 3), 8, 1),
        "prepare blocks bf16 K=V=256 gate": ("chunk.prepare", blocks, prep(True, 256, 256, gate=True), 8, 1),
        "prepare blocks fp64": ("chunk.prepare", blocks, prep(True, 64, 64, F64, F64, ("ieee",) * 3, tl.float64), 4,
                                1),
        "scan fp32 tf32x3 K=V=256 BV=32": ("chunk.scan", scan.chunk_state_kernel, scn(256, 256, 32, F32, "tf32x3"), 8,
                                           1),
        "scan fp32 K=V=100": ("chunk.scan", scan.chunk_state_kernel, scn(100, 100, 64, F32, "ieee"), 8, 1),
        "dense chunk map": ("chunk.slots", slots.dense_map_kernel, dict(buf=I64, B=3, T=1000, NC=50, nch=16, C=64,
                                                                        BLOCK=1024), 4, 1),
        "cumsum": ("chunk.decays", stage_kernels.chunk_cumsum_kernel, dict(stage, g=F32, A_log=F32, dt_bias=F32,
                                                                           Gam=F32, Gl=F32, K=100, BK=64), 4, 1),
        **{f"intra {'blocks' if blk else 'anchored'} K={K} BK={bk}": ("chunk.intra", stage_kernels.chunk_intra_kernel,
            dict(stage, **qk, q=BF, k=BF, g=F32, beta=BF, A_log=F32, dt_bias=F32, Mqk=F32, Mkk=F32, Qt=BF, Kend=BF,
                 Kt=BF, Gl=F32, flag=torch.int8, scale=0.1, K=K, BK=bk, PREC="tf32", ASPAN=80.0, SPAN=80.0,
                 BLOCKS=blk),
            4, 1) for blk, K, bk in ((False, 128, 64), (False, 100, 32), (True, 128, 32))},
        **{f"solve K=V={K} BK={bk} BV={bv} tm={tm}": ("chunk.solve", stage_kernels.chunk_solve_kernel,
            dict(stage, **qk, Mkk=F32, k=BF, v=BF, g=F32, beta=BF, A_log=F32, dt_bias=F32, Tm=F32, W=BF, U=BF, K=K,
                 V=K, BK=bk, BV=bv, PREC_SOLVE="tf32", PREC_WY="tf32", STORE_TM=tm), 4, 1)
           for K, bk, bv, tm in ((128, 64, 64, False), (100, 32, 64, True))},
        "anchor sums K=128 BK=64 gate": ("chunk.decays", decays.anchor_sums_kernel,
                                         dict(g=F32, A_log=F32, dt_bias=F32, Sums=F32, **stage, K=128, BK=64), 2, 1),
        "output": ("chunk.output", output.chunk_output_kernel, dict(Qt=BF, Mqk=F32, Hin=F32, E=F32, o=BF, Nq=None,
                   slot_start=I64, slot_count=I64, Keep=None, NC=17, HV=32, T=1000, K=100, V=100, BK=128, BV=64, BT=64,
                   PREC="bf16", DT=tl.float32, NORMS=False, STAGES=1), 4, 1),
    }  # fmt: skip


def backward_launches(x_dtype: torch.dtype = BF, H: int = 32, D: int = 128, tag: str = "",
                      segments: int | None = None) -> dict[str, Variant]:  # fmt: skip
    """Every kernel of the chunk backward as its driver launches it on an H200 (132 SMs) for ``x_dtype`` inputs
    (bf16), ``H`` (32) heads, K = V = ``D`` (128), l2norm, initial state and final-state gradient: the driver runs
    on small CPU tensors with Triton's launch replaced by a recorder, so the variants follow the launchers' own tiles
    and warps. Each belongs to the module that defines its kernel; ``tag`` marks the names of a non-default set. A
    second run with V-first states adds the kernels that read or write them. ``segments``: the scans split so."""
    from triton.runtime.jit import JITFunction

    from kda_ops.common import Options
    from kda_ops.testing import make_inputs
    from kda_ops.triton import KERNELS
    from kda_ops.triton.chunk import scan
    from kda_ops.triton.launch import force_forms

    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    original = JITFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        calls.append((self, args, kwargs))

    num_sms = scan.num_sms
    JITFunction.run = record  # type: ignore[method-assign]
    scan.num_sms = lambda device: 132  # type: ignore[assignment]  # the scan's value tile follows the SM count
    try:
        x = make_inputs(1, 128, H, D, D, dtype=x_dtype)
        do = torch.randn(1, 128, H, D, dtype=x_dtype)
        for v_first in (False, True):
            with force_forms(scan_segments=segments):
                KERNELS["chunk_bwd"](do, torch.randn(1, H, D, D), x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5,
                                     torch.zeros(1, H, D, D), None, None, None,
                                     Options(use_qk_l2norm=True, state_v_first=v_first))  # fmt: skip
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
        scan.num_sms = num_sms  # type: ignore[assignment]
    out: dict[str, Variant] = {}
    for fn, args, kwargs in calls:
        meta = dict(kwargs)
        warps, stages = meta.pop("num_warps", 4), meta.pop("num_stages", 3)
        a: dict[str, Any] = {n: v.dtype if isinstance(v, torch.Tensor) else v for n, v in zip(fn.arg_names, args)}
        for param in fn.params[len(args):]:  # a parameter neither passed nor defaulted: a KeyError
            a[param.name] = meta[param.name] if param.name in meta or not param.has_default else param.default
        flags = "".join(f" {flag}" for flag in ("BLOCKS", "BACKWARD", "STORE_TM", "STATE_V_FIRST") if meta.get(flag))
        flags += f" PHASE {meta['PHASE']}" if meta.get("PHASE") else ""
        source = fn.__module__.removeprefix("kda_ops.triton.")
        out.setdefault(f"bwd{tag} {fn.__name__}{flags}", (source, fn, a, warps, stages))
    return out


# -------------------------------------------------------------------------------------- recurrent kernels

STAGES = int(os.environ.get("STAGES", "3"))  # triton's default: the recurrent launchers do not set num_stages
RECURRENT_ALL = dict(USE_L2NORM=True, USE_GATE=True, HAS_A_LOG=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=False,
                     USE_BETA_SIGMOID=True, NEG_EIGVAL=True)  # fmt: skip
RECURRENT_PLAIN = dict(USE_L2NORM=False, USE_GATE=False, HAS_A_LOG=False, HAS_DT_BIAS=False, USE_LOWER_BOUND=False,
                       USE_BETA_SIGMOID=False, NEG_EIGVAL=False)  # fmt: skip
RECURRENT_BOUND = dict(RECURRENT_PLAIN, USE_GATE=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=True)  # lower bound, no A_log


def recurrent_variants() -> dict[str, Variant]:
    import triton.language as tl

    from kda_ops.triton.launch import recurrent_bwd_config, recurrent_config
    from kda_ops.triton.recurrent.backward import recurrent_bwd_kernel
    from kda_ops.triton.recurrent.forward import recurrent_fwd_kernel

    def forward(K: int, V: int, x: torch.dtype, opts: dict[str, bool], *, serving: bool = False,
                varlen: bool = False, state: bool = True, v_first: bool = False,
                spec: bool = False, pool: torch.dtype | None = None) -> Variant:  # fmt: skip
        s = F64 if x == F64 else F32
        p = pool or s
        BK, BV, warps = recurrent_config(K, V, v_first, p.itemsize)
        args = dict(q=x, k=x, v=x, g=s, beta=x, o=x, h0=p if state else None, ht=p if state else None,
                    cu_seqlens=I32 if varlen else None, state_indices=I32 if serving or spec else None,
                    num_accepted=I32 if spec else None, NSPEC=4, SPEC=spec, HAS_ACCEPTED=spec,
                    A_log=F32 if opts["HAS_A_LOG"] else None, dt_bias=F32 if opts["HAS_DT_BIAS"] else None,
                    scale=0.1, lower_bound=-5.0, T=7, NS=9, H=8, HV=32, K=K, V=V, BK=BK, BV=BV,
                    DT=tl.float64 if x == F64 else tl.float32, **opts, USE_INITIAL_STATE=state,
                    STORE_FINAL_STATE=state, IS_VARLEN=varlen, USE_STATE_INDICES=serving,
                    STATE_V_FIRST=v_first)  # fmt: skip
        return "recurrent.forward", recurrent_fwd_kernel, args, warps, STAGES

    def backward(K: int, V: int, x: torch.dtype, opts: dict[str, bool], *, varlen: bool = False,
                 state: bool = True, v_first: bool = False) -> Variant:  # fmt: skip
        BK, BV, warps = recurrent_bwd_config(K, V)
        s = F64 if x == F64 else F32
        args = dict(q=x, k=x, v=x, g=s, beta=x, do=x, dht=s if state else None, h0=s if state else None, dq=s,
                    dk=s, dv=x, dg=s, dbeta=s, dh0=s if state else None, dA=s if opts["HAS_A_LOG"] else None,
                    ddt=s if opts["HAS_DT_BIAS"] else None, ckpt=s, scratch=s, cu_seqlens=I64 if varlen else None,
                    A_log=F32 if opts["HAS_A_LOG"] else None, dt_bias=F32 if opts["HAS_DT_BIAS"] else None,
                    scale=0.1, lower_bound=-5.0, T=7, TOT=7, N=3, C=8, H=8, HV=32, K=K, V=V, BK=BK, BV=BV,
                    DT=tl.float64 if x == F64 else tl.float32, **opts, USE_INITIAL_STATE=state,
                    USE_FINAL_STATE_GRADIENT=state, IS_VARLEN=varlen, STATE_V_FIRST=v_first)  # fmt: skip
        return "recurrent.backward", recurrent_bwd_kernel, args, warps, STAGES

    # "decode ..." variants are the performance-critical ones: the test requires them not to spill.
    return {
        "decode serving bf16 K=V=128 all options": forward(128, 128, BF, RECURRENT_ALL, serving=True),
        "decode serving bf16 K=V=128 plain varlen": forward(128, 128, BF, RECURRENT_PLAIN, serving=True,
                                                            varlen=True),
        "decode speculative verify bf16 K=V=128 all options": forward(128, 128, BF, RECURRENT_ALL, spec=True,
                                                                      varlen=True),
        "decode serving bf16 K=V=128 all options, bf16 pool": forward(128, 128, BF, RECURRENT_ALL, serving=True,
                                                                       pool=BF),
        "decode recurrent bf16 K=V=128 l2norm": forward(128, 128, BF, dict(RECURRENT_PLAIN, USE_L2NORM=True)),
        # the V-first serving step spills 24 B (8 B plain) a thread: outside the no-spill bound until its speed
        # under a CUDA graph is measured against the K-first step's
        "serving V-first bf16 K=V=128 all options": forward(128, 128, BF, RECURRENT_ALL, serving=True,
                                                            v_first=True),
        "serving V-first bf16 K=V=128 plain varlen": forward(128, 128, BF, RECURRENT_PLAIN, serving=True,
                                                             varlen=True, v_first=True),
        "decode recurrent bf16 K=V=128 l2norm V-first": forward(128, 128, BF, dict(RECURRENT_PLAIN, USE_L2NORM=True),
                                                                v_first=True),
        "forward fp32 K=100 V=72 lower bound varlen": forward(100, 72, F32, RECURRENT_BOUND, varlen=True),
        "forward bf16 K=V=256 all options": forward(256, 256, BF, RECURRENT_ALL),
        "forward fp16 K=V=16 no state": forward(16, 16, F16, RECURRENT_PLAIN, state=False),
        "forward fp64 K=V=64 all options": forward(64, 64, F64, RECURRENT_ALL),
        "backward bf16 K=V=128 all options varlen": backward(128, 128, BF, RECURRENT_ALL, varlen=True),
        "backward fp32 K=V=128 plain no state": backward(128, 128, F32, RECURRENT_PLAIN, state=False),
        "backward bf16 K=100 V=72 lower bound": backward(100, 72, BF, RECURRENT_BOUND),
        "backward bf16 K=V=256 all options": backward(256, 256, BF, RECURRENT_ALL),
        "backward fp64 K=V=64 all options": backward(64, 64, F64, RECURRENT_ALL),
        "backward bf16 K=V=128 all options varlen V-first": backward(128, 128, BF, RECURRENT_ALL, varlen=True,
                                                                     v_first=True),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------- runner

TABLES: dict[str, Callable[[], dict[str, Variant]]] = {
    "chunk": lambda: {**chunk_variants(), **backward_launches(), **backward_launches(F16, tag=" fp16"),
                      **backward_launches(F16, 4, 256, " fp16 K=V=256 H4"),
                      **backward_launches(BF, 4, 256, " bf16 K=V=256 H4"),
                      **backward_launches(BF, 4, 128, " split H4", segments=4)},
    "recurrent": recurrent_variants,
}


def split_arguments(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """``argv`` as sources and ``NAME=VALUE`` overrides, each value a Python literal (``BV=64``, ``num_warps=4``,
    ``PREC='tf32'``); a ValueError names the argument that is neither."""
    sources: list[str] = []
    over: dict[str, Any] = {}
    for arg in argv:
        name, eq, value = arg.partition("=")
        if not eq:
            sources.append(arg)
            continue
        try:
            if not name.isidentifier():
                raise ValueError(name)
            over[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"argument {arg!r}: expected SOURCE or NAME=LITERAL") from e
    return sources, over


def with_overrides(names: list[str], args: dict[str, Any], warps: int, stages: int,
                   over: dict[str, Any]) -> tuple[dict[str, Any], int, int]:  # fmt: skip
    """A variant's arguments, warps and stages with the overrides that apply to its kernel (``num_warps``,
    ``num_stages``, and the kernel's parameters ``names``: its tiles, its constexpr forms) in place of its own."""
    args = {**args, **{k: v for k, v in over.items() if k in names}}
    return args, int(over.get("num_warps", warps)), int(over.get("num_stages", stages))


def main(argv: list[str]) -> int:
    """Compile the variants of the sources in ``argv`` (every variant without any); a variant whose source has no
    test (not in :data:`SOURCES`) is reported as a failure. ``NAME=VALUE`` arguments (:func:`split_arguments`)
    override every variant's launch or kernel parameters of that name: a launch or a kernel form probed for sm_90
    without a GPU (``python -m tests.triton.sm90 chunk.dqk BK=64 num_warps=4``)."""
    try:
        sources, over = split_arguments(argv)
    except ValueError as e:
        print(json.dumps({"variant": "arguments", "ok": False, "error": str(e)}))
        return 1
    wanted = set(sources) or set(SOURCES)
    unknown = wanted - set(SOURCES)
    if unknown:
        print(json.dumps({"variant": "arguments", "ok": False, "error": f"unknown sources {sorted(unknown)}"}))
        return 1
    failures = 0
    applied: set[str] = set()
    for family in sorted({source.split(".")[0] for source in wanted}):
        for name, (source, kernel, args, warps, stages) in TABLES[family]().items():
            if source not in SOURCES:
                failures += 1
                print(json.dumps({"variant": name, "source": source, "ok": False,
                                  "error": f"source {source} has no compile test"}), flush=True)  # fmt: skip
                continue
            if source not in wanted:
                continue
            names = jit_function(kernel).arg_names
            applied.update(k for k in over if k in names or k in ("num_warps", "num_stages"))
            args, warps, stages = with_overrides(names, args, warps, stages, over)
            try:
                info: dict[str, Any] = {"variant": name, "source": source, "ok": True, "num_warps": warps,
                                        **resources(build(kernel, args, warps, stages))}  # fmt: skip
                # the intra block pass is exempt: it exits at once for every chunk the anchored pass did not flag,
                # so its spills cost only on chunks with extreme gates
                bound = (BACKWARD_MAX_STACK_256 if "K=V=256" in name else
                         BACKWARD_MAX_STACK_SPLIT if " split " in name else BACKWARD_MAX_STACK)  # fmt: skip
                if name.startswith("bwd ") and "BLOCKS" not in name and info["stack"] > bound:
                    failures += 1
                    info.update(ok=False, error=f"spills {info['stack']} B per thread (bound {bound})")
                if info["shared"] > SHARED_LIMIT:
                    failures += 1
                    info.update(ok=False, error=f"needs {info['shared']} B of shared memory (limit {SHARED_LIMIT})")
            except Exception as e:  # noqa: BLE001 - reported per variant; the exit status says whether any failed
                failures += 1
                error = f"{type(e).__name__}: {str(e)[-2000:]}"
                info = {"variant": name, "source": source, "ok": False, "error": error}
            print(json.dumps(info), flush=True)
    unused = sorted(set(over) - applied)
    if unused:  # a misspelt override would otherwise leave every variant as configured, silently
        failures += 1
        error = f"overrides {unused} name no parameter of a compiled variant's kernel"
        print(json.dumps({"variant": "arguments", "ok": False, "error": error}))
    return 1 if failures else 0


# --------------------------------------------------------------------------------------------- the tests


def probe(*argv: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """This script run on ``argv`` in a subprocess without ``TRITON_INTERPRET``: the process and its JSON records.
    Skips when this triton has no bundled ptxas."""
    import pytest

    triton = pytest.importorskip("triton", minversion="3.6")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.triton.sm90", *argv], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=1800)  # fmt: skip
    return run, [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def check_compiles(source: str, *overrides: str,
                   no_spills: Callable[[str], bool] = lambda name: False) -> list[dict[str, Any]]:  # fmt: skip
    """Compile the variants of ``source`` (:func:`probe`; ``overrides``: ``NAME=VALUE`` arguments, :func:`main`) and
    assert that each compiled within its bounds (and, for the variants ``no_spills`` names, that none spills);
    returns their JSON records. Runs, and means the same, on a machine with a GPU."""
    run, results = probe(source, *overrides)
    assert results, f"no result from tests/triton/sm90.py {source}: {run.stderr[-3000:]}"
    failed = [f"{r['variant']}: {r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert run.returncode == 0, run.stderr[-3000:]
    spills = [f"{r['variant']}: {r['stack']} bytes" for r in results
              if no_spills(r["variant"]) and r.get("stack", 0) > 0]  # fmt: skip
    assert not spills, "spills: " + ", ".join(spills)
    return results


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
