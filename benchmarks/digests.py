"""Digests of every output and gradient of the public functions on a fixed set of inputs: a change that must not
touch any kernel's arithmetic (a move, a rename) leaves every digest equal, bit for bit.

    python benchmarks/digests.py --out before.json                 # CUDA when present, else the CPU
    python benchmarks/digests.py --out after.json --compare before.json

On the CPU the Triton kernels run under the interpreter (``TRITON_INTERPRET=1 KDA_OPS_CPU_BACKEND=triton``, set
here) with tiny shapes; on CUDA the cases use K = V = 128 and one odd size. Only the public functions are called,
so the script runs unchanged on trees whose internals differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

if "cpu" in sys.argv or not torch.cuda.is_available():  # before triton is imported: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("KDA_OPS_CPU_BACKEND", "triton")

import kda_ops  # noqa: E402


def digest(x: torch.Tensor | None) -> str:
    if x is None:
        return "None"
    t = x.detach().contiguous().cpu()
    h = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return f"{h.hexdigest()[:16]} {tuple(t.shape)} {t.dtype}"


def inputs(T: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype, device: str, gate: bool, seed: int,
           logits: bool) -> dict[str, torch.Tensor]:  # fmt: skip
    """Not :func:`kda_ops.testing.make_inputs`, which draws in float64 and leaves the keys unscaled: other tensors,
    and digests taken on these would no longer compare with those taken before."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q, k, v, raw, b = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, V), rnd(1, T, HV, K), rnd(1, T, HV)
    k = k * K**-0.5  # keys of norm ~1: the delta rule stays stable without the in-kernel l2norm
    out = {
        "q": q.to(device, dtype),
        "k": k.to(device, dtype),
        "v": v.to(device, dtype),
        "g": (raw if gate else F.logsigmoid(raw)).to(device),
        "beta": (b if logits else torch.sigmoid(b)).to(device, dtype),
    }
    if gate:
        out["A_log"] = (rnd(HV) * 0.5).to(device)
        out["dt_bias"] = (rnd(HV * K) * 0.5).to(device)
    return out


def cases(device: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, settings): every option, varlen, grouped value heads, two head sizes, three dtypes."""
    gpu = device == "cuda"
    sizes = [(128, 128), (100, 72)] if gpu else [(32, 32), (24, 20)]
    T = 300 if gpu else 80
    cu = [0, 37, 37, 150, 300] if gpu else [0, 17, 17, 50, 80]
    out: list[tuple[str, dict[str, Any]]] = []
    opts: list[tuple[str, dict[str, Any]]] = [
        ("plain", {}),
        ("l2norm", {"use_qk_l2norm_in_kernel": True}),
        ("gate", {"use_gate_in_kernel": True}),
        ("gate_bound", {"use_gate_in_kernel": True, "lower_bound": -3.0}),
        ("bound_noA", {"use_gate_in_kernel": True, "lower_bound": -5.0, "no_A": True}),
        ("beta_sig_neg", {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}),
        ("all", {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
                 "scale": 0.3}),
    ]  # fmt: skip
    dtypes = [torch.bfloat16, torch.float32, torch.float16] if gpu else [torch.float32, torch.float16]
    for K, V in sizes:
        for dtype in dtypes:
            for oname, o in opts:
                for varlen in (False, True):
                    for HV in (2, 4):
                        name = f"K{K}V{V}-{str(dtype)[6:]}-{oname}-{'varlen' if varlen else 'dense'}-HV{HV}"
                        out.append((name, dict(K=K, V=V, dtype=dtype, T=T, HV=HV, cu=cu if varlen else None, **o)))
    # each option with every layout, head count and dtype in turn (a quarter of the product on a GPU, an eighth on
    # the CPU, whose interpreter is slow): every compiled form without compiling the whole product
    step = 4 if gpu else 8
    out = [c for i, c in enumerate(out) if i % step == (i // step) % step]
    return out


def rel(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if out is None or ref is None:
        return float("nan")
    o, r = out.detach().double(), ref.detach().double()
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def run_case(c: dict[str, Any], device: str, seed: int, errors: dict[str, float] | None = None) -> dict[str, str]:
    c = dict(c)
    K, V, dtype, T, HV, cu = c.pop("K"), c.pop("V"), c.pop("dtype"), c.pop("T"), c.pop("HV"), c.pop("cu")
    no_A = c.pop("no_A", False)
    gate = c.get("use_gate_in_kernel", False)
    logits = c.get("use_beta_sigmoid_in_kernel", False)
    H = 2
    dense_B = 2
    x = inputs(T, H, HV, K, V, dtype, device, gate, seed, logits)
    if cu is None:  # a dense batch of two sequences
        x = {n: (t.reshape(dense_B, T // dense_B, *t.shape[2:]) if t.dim() >= 3 else t) for n, t in x.items()}
        N = dense_B
    else:
        N = len(cu) - 1
        c["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    if no_A:
        x.pop("A_log")
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = (torch.randn(N, HV, K, V, generator=gen) * 0.5).to(device)
    res: dict[str, str] = {}
    tensors = ["q", "k", "v", "g", "beta", *(["A_log"] if "A_log" in x else []), *(["dt_bias"] if gate else [])]

    def leaves() -> dict[str, torch.Tensor]:
        return {n: x[n].detach().clone().requires_grad_(True) for n in tensors}

    kept: dict[str, torch.Tensor] = {}

    def grads(prefix: str, fn: Any, extra: dict[str, Any], f64: bool = False) -> None:
        lv = leaves()
        if f64:
            lv = {n: t.detach().double().requires_grad_(True) for n, t in lv.items()}
        h = h0.clone().requires_grad_(True)
        args = {**{n: t for n, t in lv.items() if n in ("A_log", "dt_bias")}, **c, **extra}
        o, s = fn(lv["q"], lv["k"], lv["v"], lv["g"], lv["beta"], initial_state=h, output_final_state=True, **args)
        gen2 = torch.Generator().manual_seed(seed + 2)
        do = torch.randn(o.shape, generator=gen2).to(device, o.dtype)
        ds = torch.randn(s.shape, generator=gen2).to(device, s.dtype)
        ((o.double() * do.double()).sum() + (s.double() * ds.double()).sum()).backward() if f64 else (
            (o.float() * do.float()).sum() + (s * ds).sum()
        ).backward()
        outs = {
            f"{prefix}.o": o,
            f"{prefix}.final": s,
            f"{prefix}.dh0": h.grad,
            **{f"{prefix}.d{n}": t.grad for n, t in lv.items()},
        }
        for key, val in outs.items():
            if f64:
                if errors is not None and key.replace("_f64", "") in kept:
                    errors[key.replace("_f64", "")] = rel(kept[key.replace("_f64", "")], val)
            else:
                res[key] = digest(val)
                if val is not None:
                    kept[key] = val.detach()

    opt = {n: x[n] for n in ("A_log", "dt_bias") if n in x}
    with torch.no_grad():
        o, s = kda_ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, output_final_state=True,
                                 **opt, **c)  # fmt: skip
        res["chunk.o"], res["chunk.final"] = digest(o), digest(s)
        kept["chunk.o"], kept["chunk.final"] = o, s
        o, _ = kda_ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **opt, **c)
        res["chunk_nostate.o"] = digest(o)
        o, s = kda_ops.recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                     output_final_state=True, **opt, **c)  # fmt: skip
        res["recurrent.o"], res["recurrent.final"] = digest(o), digest(s)
        kept["recurrent.o"], kept["recurrent.final"] = o, s
        pool = torch.randn(N + 3, HV, K, V, generator=gen).to(device)
        slots = torch.tensor([N + 2 - i if i % 2 == 0 else -1 for i in range(N)], dtype=torch.int64, device=device)
        o = kda_ops.recurrent_kda_update_(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots, **opt, **c)
        res["serving.o"], res["serving.pool"] = digest(o), digest(pool)
    grads("train", kda_ops.chunk_kda, {})
    grads("recompute", kda_ops.chunk_kda, {"recompute_in_backward": True})
    if T <= 128 or dtype == torch.float32:  # the recurrent backward: one dtype at GPU sizes (it is slow)
        grads("recurrent_bwd", kda_ops.recurrent_kda, {})
        if errors is not None:  # errors against the same function in float64
            grads("recurrent_bwd_f64", kda_ops.recurrent_kda, {}, f64=True)
    if errors is not None:
        with torch.no_grad():
            x64 = {n: t.double() for n, t in x.items()}
            opt64 = {n: x64[n] for n in ("A_log", "dt_bias") if n in x64}
            o64, s64 = kda_ops.recurrent_kda(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], initial_state=h0,
                                             output_final_state=True, **opt64, **c)  # fmt: skip
        for key, val in kept.items():
            if key.endswith(".o") or key.endswith(".final"):
                errors[key] = rel(val, o64 if key.endswith(".o") else s64)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare")
    ap.add_argument("--limit", type=int, default=0, help="only the first N cases (a quick run)")
    ap.add_argument("--only", nargs="*", help="only the cases whose name holds one of these strings")
    ap.add_argument("--shard", default="0/1", help="k/n: run the cases i with i %% n == k (parallel processes)")
    ap.add_argument("--merge", nargs="*", help="merge these shard outputs into --out (no cases run)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    all_cases = cases(a.device)
    if a.limit:
        all_cases = all_cases[: a.limit]
    if a.only:
        all_cases = [(name, c) for name, c in all_cases if any(s in name for s in a.only)]
    k, n = (int(x) for x in a.shard.split("/"))
    out: dict[str, str] = {}
    errs: dict[str, float] = {}
    for path in a.merge or []:
        with open(path) as f:
            out.update(json.load(f))
        with open(path + ".errors") as f:
            errs.update(json.load(f))
    for i, (name, c) in enumerate(all_cases):
        if a.merge is not None or i % n != k:
            continue
        e: dict[str, float] = {}
        for key, d in run_case(c, a.device, seed=i, errors=e).items():
            out[f"{name}/{key}"] = d
        errs.update({f"{name}/{key}": v for key, v in e.items()})
    with open(a.out, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    with open(a.out + ".errors", "w") as f:
        json.dump(errs, f, indent=0, sort_keys=True)
    whole = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()[:16]
    print(f"{len(out)} tensors, digest of all {whole}")
    if a.compare:
        with open(a.compare) as f:
            ref = json.load(f)
        diff = sorted(k for k in set(ref) | set(out) if ref.get(k) != out.get(k))
        try:
            with open(a.compare + ".errors") as f:
                ref_errs = json.load(f)
        except OSError:
            ref_errs = {}
        groups: dict[str, int] = {}
        for k in diff:
            part = k.split("/", 1)[1]
            groups[part] = groups.get(part, 0) + 1
            if k in errs or k in ref_errs:
                before, after = ref_errs.get(k, float("nan")), errs.get(k, float("nan"))
                print(f"DIFFERS {k}: error vs float64 {before:.3e} -> {after:.3e}")
            else:
                print(f"DIFFERS {k}")
        print("differing tensors by output:", json.dumps(groups, sort_keys=True))
        print(f"compare with {a.compare}: {len(diff)} of {len(ref)} tensors differ")
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
