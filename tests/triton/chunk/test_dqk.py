"""``kda_ops.triton.chunk.dqk``: the backward's stage 3b (``dq``, ``dk``, ``dg``, the whole ``dbeta``), fed the
float64 oracle's factors and stage 3a, against its oracle (``kda_ops.reference.chunk.dqk``), both its anchored and
its block pass, under the interpreter and on CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops import reference  # noqa: E402
from kda_ops.reference.chunk.dqk import dqk as oracle_dqk  # noqa: E402
from kda_ops.reference.chunk.dv import dv as oracle_dv  # noqa: E402
from kda_ops.testing import assert_rel  # noqa: E402
from kda_ops.triton import launch  # noqa: E402
from kda_ops.triton.chunk import dqk  # noqa: E402
from kda_ops.triton.chunk.l2norm import l2norm_factors  # noqa: E402
from kda_ops.triton.chunk.tiles import BT  # noqa: E402
from kda_ops.triton.launch import poison_outputs  # noqa: E402
from tests.triton.chunk.stages import OVERFLOW_WARNINGS, bwd_precisions, bwd_stage_case, dv_inputs, f32  # noqa: E402
from tests.triton.sm90 import check_compiles  # noqa: E402

pytestmark = [*OVERFLOW_WARNINGS, pytest.mark.usefixtures("triton_path")]

NAMES = ("q", "k", "Gam", "Gl", "beta", "dMqk", "dMkk", "dKt", "Hin", "E", "dSp", "dO", "dbeta")


def _dqk_case(gates: str, device: torch.device, K: int = 20, V: int = 12) -> dict[str, Any]:
    """A backward stage case with the oracle's stage 3a (the dq/dk stage's inputs)."""
    c = bwd_stage_case(gates, H=1, HV=2, K=K, V=V, device=device)
    c.update(dv_inputs(c))
    _, dbeta, dMqk, dMkk, dKt, Gam = oracle_dv(c["k"], c["v"], c["g"], c["beta"], c["Tm"], c["Hin"], c["E"],
                                               c["dE"], c["dO"], c["slots"], BT)  # fmt: skip
    c.update(dbeta=dbeta, dMqk=dMqk, dMkk=dMkk, dKt=dKt, Gam=Gam)
    return c


@pytest.mark.parametrize("gates", ["normal", "reset", "half_reset", "zero"])
def test_stage_dqk(gates: str, device: torch.device) -> None:
    """The dq/dk stage against its float64 oracle, every output poisoned first (K = 40: two key tiles, the second
    partial; with ``half_reset`` one chunk's key tiles span differently)."""
    c = _dqk_case(gates, device, K=40)
    prec, _ = bwd_precisions(device, exact=True)
    with poison_outputs():
        got = dqk.chunk_bwd_dqk(*f32(c, *NAMES), 0.4, c["slots"], prec, g=c["g"].float())
    ref = oracle_dqk(*(c[n] for n in NAMES), 0.4, c["slots"], BT)
    # resets: Gam reaches -1000 and fp32 rounds it to ~6e-5 nats, which the pairwise differences carry
    tol = 1e-4 if gates.endswith("reset") else 1e-5
    for name, a, b in zip(("dq", "dk", "dg", "dbeta"), got, ref):
        assert_rel(a, b, tol, name)


def test_stage_dqk_writes_dg_over_gam(device: torch.device) -> None:
    """The stage allocates no ``[T, HV, K]`` buffer for dg: it writes it over ``Gam``, the memory that the epilogue's
    outputs take instead (the block pass's tests check that it forms its chunks' ``Gam`` again)."""
    c = _dqk_case("normal", device)
    prec, _ = bwd_precisions(device, exact=True)
    args = f32(c, *NAMES)
    got = dqk.chunk_bwd_dqk(*args, 0.4, c["slots"], prec, g=c["g"].float())
    assert got[2].data_ptr() == args[2].data_ptr()


@pytest.mark.parametrize("blocks", [False, True], ids=["anchored", "blocks"])
def test_stage_dqk_split_products(blocks: bool, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 2xTF32 form of fp16 inputs (``prec="tf32x2"``: ``dMqk``, ``dMkk`` the exact first operands) against the
    float64 oracle on the same fp16-rounded ``dMqk``, ``dMkk``, in both passes (the anchored span below 0 flags
    every chunk for the block pass): on CUDA too the gradients of exact products, to the split's ~2^-20."""
    c = _dqk_case("normal", device, K=40)
    for n in ("dMqk", "dMkk"):  # stored in fp16, as the backward stores them for fp16 inputs: exact in TF32
        c[n] = c[n].to(torch.float16).to(c[n].dtype)
    if blocks:
        monkeypatch.setattr(dqk, "ANCHOR_SPAN", -1.0)
    with poison_outputs():
        got = dqk.chunk_bwd_dqk(*f32(c, *NAMES), 0.4, c["slots"], "tf32x2", prec_state="ieee", g=c["g"].float())
    ref = oracle_dqk(*(c[n] for n in NAMES), 0.4, c["slots"], BT)
    for name, a, b in zip(("dq", "dk", "dg", "dbeta"), got, ref):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize(
    ("blocks", "flags"),
    [(False, {}), (True, {}), pytest.param(False, {"PREFETCH": 0}, marks=pytest.mark.slow),
     pytest.param(False, {"PREFETCH": 2, "HOLD_DM": 1}, marks=pytest.mark.slow)],
    ids=["anchored", "blocks", "anchored_no_prefetch", "anchored_prefetch"],
)
def test_stage_dqk_l2norm_epilogue(blocks: bool, flags: dict[str, int], device: torch.device,
                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """With ``norm_dtype`` (one value head per key head) the stage returns the raw rows' gradients through their
    l2norm, in both passes (and with the anchored pass's loads ahead or not, which scale the raw rows a tile later or
    at once): the oracle's dq, dk of the normalised rows chained through float64 autograd of the reference l2norm."""
    monkeypatch.setitem(launch.LAUNCH, "dqk", {**launch.LAUNCH["dqk"], **flags})
    c = bwd_stage_case("half_reset", H=2, HV=2, K=40, device=device)
    c.update(dv_inputs(c))
    _, dbeta, dMqk, dMkk, dKt, Gam = oracle_dv(c["k"], c["v"], c["g"], c["beta"], c["Tm"], c["Hin"], c["E"],
                                               c["dE"], c["dO"], c["slots"], BT)  # fmt: skip
    c.update(dbeta=dbeta, dMqk=dMqk, dMkk=dMkk, dKt=dKt, Gam=Gam)
    # raw rows whose l2norm is the case's q, k: each row times its own factor in (0.5, 2)
    gen = torch.Generator().manual_seed(3)
    raw = {n: c[n] * (0.5 + 1.5 * torch.rand(c[n].shape[:-1], generator=gen, dtype=c[n].dtype)).to(device)[..., None]
           for n in ("q", "k")}  # fmt: skip
    norms = torch.stack([l2norm_factors(raw[n].float(), torch.float32) for n in ("q", "k")])
    prec, _ = bwd_precisions(device, exact=True)
    if blocks:
        monkeypatch.setattr(dqk, "ANCHOR_SPAN", -1.0)
    args = f32(c, *NAMES)
    args[:2] = raw["q"].float(), raw["k"].float()
    with poison_outputs():  # the stage writes dg over Gam: a copy each call
        got = dqk.chunk_bwd_dqk(*args[:2], args[2].clone(), *args[3:], 0.4, c["slots"], prec, norms=norms,
                                norm_dtype=torch.float32, g=c["g"].float())  # fmt: skip
    c.update(q=reference.l2norm(raw["q"]), k=reference.l2norm(raw["k"]))  # the rows the kernel forms
    ref = oracle_dqk(*(c[n] for n in NAMES), 0.4, c["slots"], BT)
    for name, x, dy, out in zip(("dq", "dk"), (raw["q"], raw["k"]), ref[:2], got[:2]):
        x = x.detach().requires_grad_()
        (want,) = torch.autograd.grad(reference.l2norm(x), x, dy)
        assert out.dtype == torch.float32 and out.shape == x.shape
        assert_rel(out, want, 1e-4, name)
    for name, a, b in zip(("dg", "dbeta"), got[2:], ref[2:]):
        assert_rel(a, b, 1e-4, name)
    # in bf16: the same fp32 values, rounded once as they are stored (to 2^-8 of the largest entry)
    with poison_outputs():
        half = dqk.chunk_bwd_dqk(*args, 0.4, c["slots"], prec, norms=norms, norm_dtype=torch.bfloat16,
                                 g=c["g"].float())  # fmt: skip
    for name, a, b in zip(("dq", "dk"), half[:2], got[:2]):
        assert a.dtype == torch.bfloat16, name
        assert_rel(a.float(), b, 2**-8, name)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{"PREFETCH": 0}, {"PREFETCH": 2, "HOLD_DM": 1}, {"HOLD_DOE": 1}],
                         ids=["no_prefetch", "prefetch_dkt_hold_dm", "hold_doe"])  # fmt: skip
def test_stage_dqk_schedule_flags(flags: dict[str, int], device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The anchored pass's schedule flags in the launch table (the next key tile's loads ahead of the stores or not,
    tiles held across the key loop) give the same gradients: against the oracle, and equal bit for bit to the default
    form's where the products are the same (``HOLD_DOE`` sums the value tiles in one product). K = 40: two key
    tiles, the second partial; V = 72: two value tiles (of 64), the second partial; ``half_reset`` sends one chunk
    through the block pass, which takes no flags."""
    c = _dqk_case("half_reset", device, K=40, V=72)
    prec, _ = bwd_precisions(device, exact=True)
    with poison_outputs():
        base = dqk.chunk_bwd_dqk(*f32(c, *NAMES), 0.4, c["slots"], prec, g=c["g"].float())
        monkeypatch.setitem(launch.LAUNCH, "dqk", {**launch.LAUNCH["dqk"], **flags})
        got = dqk.chunk_bwd_dqk(*f32(c, *NAMES), 0.4, c["slots"], prec, g=c["g"].float())
    ref = oracle_dqk(*(c[n] for n in NAMES), 0.4, c["slots"], BT)
    for name, a, b, r in zip(("dq", "dk", "dg", "dbeta"), got, base, ref):
        assert_rel(a, r, 1e-4, name)
        assert "HOLD_DOE" in flags or torch.equal(a, b), name


@pytest.mark.slow
def test_stage_dqk_block_pass_equals_anchored_pass(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the anchored span below 0 the first pass flags every chunk and the block pass computes them all: the
    same gradients as the anchored pass (two fp32 factorings of the same decays)."""
    c = _dqk_case("normal", device)
    prec, _ = bwd_precisions(device, exact=True)
    with poison_outputs():
        anchored = dqk.chunk_bwd_dqk(*f32(c, *NAMES), 0.4, c["slots"], prec, g=c["g"].float())
        monkeypatch.setattr(dqk, "ANCHOR_SPAN", -1.0)
        blocks = dqk.chunk_bwd_dqk(*f32(c, *NAMES), 0.4, c["slots"], prec, g=c["g"].float())
    for name, a, b in zip(("dq", "dk", "dg", "dbeta"), anchored, blocks):
        assert_rel(a, b, 1e-5, name)


def test_kernels_compile_for_sm90() -> None:
    """The dq/dk stage (both passes) lowers for sm_90 as the backward launches it, its anchored pass within the
    backward's spill bound (``tests/triton/sm90.py``)."""
    check_compiles("chunk.dqk")


@pytest.mark.slow
def test_schedule_flags_compile_for_sm90() -> None:
    """The anchored pass with its loads ahead and ``[dMqk; dMkk]`` held lowers for sm_90 within the spill bound."""
    check_compiles("chunk.dqk", "PREFETCH=2", "HOLD_DM=1")
