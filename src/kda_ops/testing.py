"""Input factories and the error measure that the tests, the benchmarks and users share."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def rel_err(out: Tensor, ref: Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; ``inf`` if ``out`` has a NaN or an infinity."""
    o, r = out.detach().double(), ref.detach().double().to(out.device)
    if not torch.isfinite(o).all():  # sync-ok: test helper
        return math.inf
    den = float(r.norm())  # sync-ok: test helper
    num = float((o - r).norm())  # sync-ok: test helper
    return num / den if den > 0 else num


def assert_rel(out: Tensor, ref: Tensor, tol: float, name: str = "output") -> None:
    """Fail with the measured error when ``rel_err(out, ref) > tol``."""
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def make_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    *,
    HV: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    gate_in_kernel: bool = False,
    beta_logits: bool = False,
    gate_scale: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Random inputs in the public contract's layout: ``q, k, v, g, beta`` (and ``A_log, dt_bias`` with the gate).

    ``g`` is a log decay ``logsigmoid(randn) * gate_scale`` (``<= 0``), or the raw gate input ``randn`` when
    ``gate_in_kernel``; ``beta`` is in ``[0, 1]``, or logits when ``beta_logits``. Keys are not normalised.
    """
    HV = H if HV is None else HV
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    raw = rnd(B, T, HV, K)
    g = raw if gate_in_kernel else F.logsigmoid(raw) * gate_scale
    b = rnd(B, T, HV)
    beta = b if beta_logits else torch.sigmoid(b)
    out: dict[str, Any] = {
        "q": q.to(device, dtype),
        "k": k.to(device, dtype),
        "v": v.to(device, dtype),
        "g": g.to(device, torch.float32 if dtype != torch.float64 else dtype),
        "beta": beta.to(device, dtype),
    }
    if gate_in_kernel:
        out["A_log"] = (rnd(HV) * 0.5).to(device, torch.float32 if dtype != torch.float64 else dtype)
        out["dt_bias"] = (rnd(HV * K) * 0.5).to(device, torch.float32 if dtype != torch.float64 else dtype)
    return out


def make_state(N: int, HV: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 1) -> Tensor:
    """A random state ``[N, HV, K, V]`` of modest size."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64) * 0.5).to(device, dtype)


def gate_reset_row(H: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                   T: int = 1000, D: int = 64) -> tuple[dict[str, Tensor], dict[str, Any]]:  # fmt: skip
    """A packed row (``cu_seqlens = [0, 256, 500, 1000]`` at T = 1000) for the gate in the kernel, whose raw inputs
    are ``randn`` with 90 % of them at -1000 (no decay there): ``(leaves, keywords)`` of ``chunk_kda``, the leaves
    q, k (l2-normalised), v, g, beta (``sigmoid(rand)``) in ``dtype`` and ``A_log = log U(1, 16)``, ``dt_bias``,
    ``initial_state`` in fp32. The gate's gradients sum dg over many tokens with cancellation: the case where a
    coarse product precision shows in dA_log and dt_bias."""
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)

    g = rnd(1, T, H, D)
    g[torch.rand(g.shape, generator=gen) < 0.9] = -1000.0
    x = {"q": rnd(1, T, H, D), "k": F.normalize(rnd(1, T, H, D), dim=-1), "v": rnd(1, T, H, D), "g": g,
         "beta": torch.sigmoid(torch.rand(1, T, H, generator=gen))}  # fmt: skip
    leaves = {n: t.to(device, dtype) for n, t in x.items()}
    leaves["A_log"] = torch.log(torch.empty(H).uniform_(1, 16, generator=gen)).to(device)
    leaves["dt_bias"] = rnd(H * D).to(device)
    leaves["initial_state"] = rnd(3, H, D, D).to(device)
    cu = torch.tensor([0, 256, 500, T], device=device, dtype=torch.int32)
    return leaves, {"use_gate_in_kernel": True, "cu_seqlens": cu, "output_final_state": True}
