"""The inputs of the chunk stage tests: a packed batch with an empty and a one-token sequence and partial chunks,
its chunk-slot map, and the float64 oracle's factors (``kda_ops.reference.chunk``) that each stage takes, so
that a stage is tested alone against its own oracle.

Every case is built on the test's device (``device`` fixture: the interpreter on the CPU, or CUDA): the random
values are drawn on the CPU and moved, so both runs see the same inputs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kda_ops import reference
from kda_ops.reference.chunk.decays import decays as oracle_decays
from kda_ops.reference.chunk.intra import intra as oracle_intra
from kda_ops.reference.chunk.prepare import prepare_flat as oracle_prepare_flat
from kda_ops.reference.chunk.prepare import x_form as oracle_x_form
from kda_ops.reference.chunk.scan import scan as oracle_scan
from kda_ops.reference.chunk.scan_bwd import scan_bwd as oracle_scan_bwd
from kda_ops.reference.chunk.solve import solve as oracle_solve
from kda_ops.testing import make_inputs, make_state
from kda_ops.triton.chunk.backward import product_precisions
from kda_ops.triton.chunk.precision import Precision, precision_for
from kda_ops.triton.chunk.tiles import BT
from kda_ops.varlen import chunk_slots
from tests.cases import CU_BWD, CU_STAGES, F64, OPTIONS, options, set_gates

CPU = torch.device("cpu")
EXACT = Precision(store=torch.float32)  # fp32 storage and products: the stage tests check the math, not rounding

# a factored product's masked (future) entries may overflow by design; the mask drops them after the product
OVERFLOW_WARNINGS = [
    pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning"),
]


def stage_precision(device: torch.device, dtype: torch.dtype = torch.float32) -> Precision:
    """The precision of a forward stage test on ``dtype`` inputs.

    fp32: :data:`EXACT` under the interpreter; on CUDA the kernels' own default for fp32 inputs (exact fp32
    products in the chunk-local stages, 3xTF32 in the scan and the output stage), within every stage test's bound.
    16-bit: the default storage (bf16 factors) with the products the interpreter computes, exact fp32 (it upcasts
    bf16 products, and its TF32 products are fp32 ones): on CUDA the default TF32 intra products miss the 1e-5 bound
    of ``Mqk`` and ``Mkk`` (7.7e-4 measured on the H200)."""
    if dtype == torch.float32:
        return EXACT if device.type == "cpu" else precision_for(torch.float32)
    return precision_for(dtype) if device.type == "cpu" else Precision(store=precision_for(dtype).store)


def bwd_precisions(device: torch.device, exact: bool = False) -> tuple[str, str]:
    """``(PREC, PREC_T)`` of a backward stage test: exact fp32 products under the interpreter; on CUDA the
    backward's own choice for fp32 inputs (3xTF32), or exact fp32 products with ``exact`` (the dq/dk stage, whose
    1e-5 bound 3xTF32 misses on the H200: dq 7.2e-5 at K = 20, and 0.12 at K = 40)."""
    return ("ieee", "ieee") if device.type == "cpu" or exact else product_precisions(torch.float32)[:2]


def used(slots: Any) -> torch.Tensor:
    """The chunk slots that hold tokens."""
    return slots.count > 0


# ----------------------------------------------------------------------------------------------- forward


def stage_case(dtype: torch.dtype, gates: str = "normal", option: str = "plain", H: int = 1, HV: int = 2,
               K: int = 20, V: int = 12, device: torch.device = CPU,
               cu_seqlens: list[int] = CU_STAGES) -> dict[str, Any]:  # fmt: skip
    """Flat inputs ``[T, ...]`` over the packed batch ``cu_seqlens`` (CU_STAGES), options, slot map and the prepared
    float64 inputs."""
    make_opts, call_opts = OPTIONS[option]
    x = make_inputs(1, cu_seqlens[-1], H, K, V, HV=HV, dtype=dtype, seed=3, device=device, **make_opts)
    set_gates(x["g"], gates)
    opts = options(call_opts)
    A_log = call_opts.get("A_log", x.get("A_log"))
    dt_bias = call_opts.get("dt_bias", x.get("dt_bias"))
    flat = {n: x[n][0] for n in ("q", "k", "v", "g", "beta")}
    cu = torch.tensor(cu_seqlens, dtype=torch.int64, device=device)
    slots = chunk_slots(cu, cu_seqlens[-1], BT)
    qp, kp, gp, bp = oracle_prepare_flat(flat["q"], flat["k"], flat["g"], flat["beta"], A_log, dt_bias, opts, F64)
    prepared = {"q": qp, "k": kp, "g": gp, "beta": bp, "v": flat["v"].double()}
    return {"flat": flat, "opts": opts, "A_log": A_log, "dt_bias": dt_bias, "cu": cu, "slots": slots, "p": prepared,
            "device": device}  # fmt: skip


def kt(c: dict[str, Any]) -> torch.Tensor:
    """The float64 ``Kt = k exp(Gam) [T, HV, K]`` of a stage case (the solve's operand of ``W``)."""
    p = c["p"]
    Gam, _ = oracle_decays(p["g"], c["slots"], BT)
    return p["k"].repeat_interleave(Gam.shape[1] // p["k"].shape[1], dim=1) * torch.exp(Gam)


def factors(c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The float64 oracle's per-chunk factors of a stage case (the inputs of the scan and the output stages)."""
    p = c["p"]
    Mqk, Mkk, Qt, Kend, Gl = oracle_intra(p["q"], p["k"], p["g"], p["beta"], 0.4, c["slots"], BT)
    Tm, W, U = oracle_solve(Mkk, p["k"], p["v"], p["g"], p["beta"], c["slots"], BT)
    MqkTb, Kb = oracle_x_form(Mqk, Kend, Tm, p["beta"], c["slots"], BT)
    return {"Mqk": Mqk, "Qt": Qt, "Kend": Kend, "Gl": Gl, "W": W, "U": U, "MqkTb": MqkTb, "Kb": Kb, "Kt": kt(c),
            "V": p["v"]}  # fmt: skip


# ---------------------------------------------------------------------------------------------- backward

N_BWD = len(CU_BWD) - 1


def bwd_stage_case(gates: str, H: int = 1, HV: int = 2, K: int = 20, V: int = 12, device: torch.device = CPU,
                   cu_seqlens: list[int] = CU_BWD) -> dict[str, Any]:  # fmt: skip
    """Prepared float64 inputs over the packed batch ``cu_seqlens`` (CU_BWD), the oracle's forward factors and
    random dO, dht."""
    CU = cu_seqlens
    N = len(CU) - 1
    x = make_inputs(1, CU[-1], H, K, V, HV=HV, dtype=F64, seed=5, device=device)
    set_gates(x["g"], gates)
    q, k, v, g, beta = (x[n][0] for n in ("q", "k", "v", "g", "beta"))
    q, k = reference.l2norm(q), reference.l2norm(k)
    cu = torch.tensor(CU, dtype=torch.int64, device=device)
    slots = chunk_slots(cu, CU[-1], BT)
    qe, ke = q.repeat_interleave(HV // H, 1), k.repeat_interleave(HV // H, 1)
    Mqk, Mkk, Qt, Kend, Gl = oracle_intra(qe, ke, g, beta, 0.4, slots, BT)
    Tm, W, U = oracle_solve(Mkk, ke, v, g, beta, slots, BT)
    h0 = make_state(N, HV, K, V, dtype=F64, device=device)
    Hin, E, _ = oracle_scan(W, U, Kend, Gl, h0, slots, BT)
    gen = torch.Generator().manual_seed(7)
    dO = torch.randn(CU[-1], HV, V, generator=gen, dtype=F64).to(device)
    dht = torch.randn(N, HV, K, V, generator=gen, dtype=F64).to(device)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu=cu, slots=slots, Mqk=Mqk, Qt=Qt, Kend=Kend, Gl=Gl, Tm=Tm, W=W,
                Hin=Hin, E=E, dO=dO, dht=dht, device=device, N=N)  # fmt: skip


def f32(c: dict[str, Any], *names: str) -> list[torch.Tensor]:
    return [c[n].float() for n in names]


def dv_inputs(c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The oracle's reverse scan on a backward stage case: ``dE`` and ``dS'``, the dv stage's inputs."""
    dE, dSp, _ = oracle_scan_bwd(c["dO"], c["Mqk"], c["Qt"], c["Kend"], c["W"], c["Gl"], c["dht"], c["slots"], BT,
                                 N_BWD)  # fmt: skip
    return {"dE": dE, "dSp": dSp}
