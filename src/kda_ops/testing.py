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
