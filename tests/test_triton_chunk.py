"""The chunkwise Triton kernels on the CPU under ``TRITON_INTERPRET=1``.

Every stage against its own oracle (``kda_ops.reference.chunk_stages``, float64) on a packed batch with an
empty and a one-token sequence and partial chunks, then the whole pipeline through ``kda_ops.chunk_kda`` (ops
routed to Triton) against the float64 naive recurrence. Every launcher's outputs and scratch buffers are
poisoned with NaN first, so an element a kernel forgets to write fails the comparison. Shapes are tiny: the
interpreter runs programs one by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import kda_ops  # noqa: E402
from kda_ops import ops, reference  # noqa: E402
from kda_ops.common import Options  # noqa: E402
from kda_ops.reference import chunk_stages as oracle  # noqa: E402
from kda_ops.reference import naive_recurrent_kda  # noqa: E402
from kda_ops.testing import assert_rel, make_inputs, make_state, rel_err  # noqa: E402
from kda_ops.triton import KERNELS  # noqa: E402
from kda_ops.triton import chunk as tc  # noqa: E402
from kda_ops.triton import chunk_intra as ti  # noqa: E402
from kda_ops.triton import chunk_prepare as ti_prepare  # noqa: E402
from kda_ops.triton import chunk_state as ts  # noqa: E402
from kda_ops.triton.chunk_common import BT, Precision, precision_for  # noqa: E402
from kda_ops.triton.chunk_cumsum import chunk_anchor_sums, chunk_local_cumsum  # noqa: E402
from kda_ops.triton.chunk_output import chunk_output  # noqa: E402
from kda_ops.triton.chunk_prepare import chunk_prepare  # noqa: E402
from kda_ops.triton.chunk_solve import chunk_solve  # noqa: E402
from kda_ops.triton.debug import poison_outputs  # noqa: E402
from kda_ops.varlen import chunk_slots  # noqa: E402

pytestmark = [
    pytest.mark.interpret,
    # a factored product's masked (future) entries may overflow by design; the mask drops them after the product
    pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning"),
]

F64 = torch.float64
EXACT = Precision(store=torch.float32)  # fp32 storage and products: the stage tests check the math, not rounding

# packed sequences of 5, 0, 65 (a full chunk and one token), 1 and 57 tokens: 7 slots, 5 of them used
CU = [0, 5, 5, 70, 71, 128]

# name -> (make_inputs options, public-function options)
OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({}, {}),
    "l2norm": ({}, {"use_qk_l2norm_in_kernel": True}),
    "gate": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True}),
    "gate_no_dt_bias": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True, "dt_bias": None}),
    "lower_bound": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True, "lower_bound": -5.0}),
    "lower_bound_no_A": ({"gate_in_kernel": True}, {"use_gate_in_kernel": True, "lower_bound": -3.0, "A_log": None}),
    "beta_sigmoid": ({"beta_logits": True}, {"use_beta_sigmoid_in_kernel": True}),
    "neg_eigval": ({"beta_logits": True}, {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}),
    "all": (
        {"gate_in_kernel": True, "beta_logits": True},
        {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
         "allow_neg_eigval": True},
    ),  # fmt: skip
}


@pytest.fixture(autouse=True)
def _triton_path() -> Iterator[None]:
    with ops.cpu_backend("triton"), poison_outputs():
        yield


def _opts(call: dict[str, Any]) -> Options:
    return Options(
        call.get("use_qk_l2norm_in_kernel", False),
        call.get("use_gate_in_kernel", False),
        call.get("use_beta_sigmoid_in_kernel", False),
        call.get("allow_neg_eigval", False),
        call.get("lower_bound"),
    )


def _set_gates(x: dict[str, Any], gates: str) -> None:
    """Decay patterns: ``normal`` (logsigmoid(randn)), ``reset`` (hard resets: g = -1000 at a few tokens, on every
    channel or on half of them), ``first_row`` (hard resets on the first row of chunks only), ``zero`` (no decay),
    ``strong`` (-4.5 per token: every 16-row block spans 72 nats, beyond the factored products, without a reset)."""
    g = x["g"]
    if gates == "reset":
        T = g.shape[1]
        g[:, [t for t in (3, 20, 64, 66, 100) if t < T]] = -1000.0
        g[:, 40 % T, :, : g.shape[-1] // 2] = -1000.0
    elif gates == "first_row":
        g[:, [t for t in (5, 69, 71) if t < g.shape[1]]] = -1000.0  # row 0 of a chunk: the anchored path keeps it
    elif gates == "zero":
        g.zero_()
    elif gates == "strong":
        g.fill_(-4.5)


# ------------------------------------------------------------------------------------------------ stages


def _stage_case(
    dtype: torch.dtype, gates: str = "normal", option: str = "plain", H: int = 1, HV: int = 2, K: int = 20, V: int = 12
) -> dict[str, Any]:
    """Flat inputs ``[T, ...]`` over the packed batch CU, options, slot map and the prepared float64 inputs."""
    make_opts, call_opts = OPTIONS[option]
    x = make_inputs(1, CU[-1], H, K, V, HV=HV, dtype=dtype, seed=3, **make_opts)
    _set_gates(x, gates)
    opts = _opts(call_opts)
    A_log = call_opts.get("A_log", x.get("A_log"))
    dt_bias = call_opts.get("dt_bias", x.get("dt_bias"))
    flat = {n: x[n][0] for n in ("q", "k", "v", "g", "beta")}
    cu = torch.tensor(CU, dtype=torch.int64)
    slots = chunk_slots(cu, CU[-1], BT)
    qp, kp, gp, bp = oracle.prepare_flat(flat["q"], flat["k"], flat["g"], flat["beta"], A_log, dt_bias, opts, F64)
    prepared = {"q": qp, "k": kp, "g": gp, "beta": bp, "v": flat["v"].double()}
    return {"flat": flat, "opts": opts, "A_log": A_log, "dt_bias": dt_bias, "cu": cu, "slots": slots, "p": prepared}


def _used(slots: Any) -> torch.Tensor:
    return slots.count > 0


def _kt(c: dict[str, Any]) -> torch.Tensor:
    """The float64 ``Kt = k exp(Gam) [T, HV, K]`` of a stage case (the solve's operand of ``W``)."""
    p = c["p"]
    Gam, _ = oracle.chunk_cumsum(p["g"], c["slots"], BT)
    return p["k"].repeat_interleave(Gam.shape[1] // p["k"].shape[1], dim=1) * torch.exp(Gam)


@pytest.mark.parametrize("option", ["plain", "gate", "gate_no_dt_bias", "lower_bound", "lower_bound_no_A"])
def test_stage_cumsum(option: str) -> None:
    c = _stage_case(torch.float32, gates="reset" if option == "plain" else "normal", option=option)
    Gam, Gl = chunk_local_cumsum(c["flat"]["g"], c["slots"], c["A_log"], c["dt_bias"], c["opts"])
    Gam_ref, Gl_ref = oracle.chunk_cumsum(c["p"]["g"], c["slots"], BT)
    assert_rel(Gam, Gam_ref, 1e-6, "Gam")
    used = _used(c["slots"])
    assert_rel(Gl[used], Gl_ref[used], 1e-6, "Gam_last")


@pytest.mark.parametrize("option", ["plain", "gate", "lower_bound"])
def test_stage_anchor_sums(option: str) -> None:
    """``chunk_anchor_sums``: per slot, ``g_0``, ``P_last`` and ``P_mid`` of the chunk's log decay after the gate,
    against the float64 oracle's prefix sums (a partial chunk's ``P_mid`` stops at its last row)."""
    c = _stage_case(torch.float32, gates="reset" if option == "plain" else "normal", option=option)
    Sums = chunk_anchor_sums(c["flat"]["g"], c["slots"], c["A_log"], c["dt_bias"], c["opts"])
    Gam_ref, Gl_ref = oracle.chunk_cumsum(c["p"]["g"], c["slots"], BT)
    used = torch.nonzero(_used(c["slots"])).flatten()
    start, count = c["slots"].start[used], c["slots"].count[used]
    g0 = Gam_ref[start]
    ref = torch.stack([g0, Gl_ref[used] - g0, Gam_ref[start + (count - 1).clamp(max=BT // 2 - 1)] - g0], dim=2)
    assert_rel(Sums[used], ref, 1e-6, "anchor sums")


@pytest.mark.parametrize(
    ("dtype", "gates", "option"),
    [
        (torch.float32, "normal", "plain"),
        (torch.float32, "reset", "l2norm"),
        (torch.float32, "first_row", "plain"),
        (torch.float32, "zero", "beta_sigmoid"),
        (torch.float32, "strong", "all"),
        (torch.float16, "normal", "neg_eigval"),
    ],
)
def test_stage_intra(dtype: torch.dtype, gates: str, option: str) -> None:
    c = _stage_case(dtype, gates, option)
    f, p = c["flat"], c["p"]
    prec = EXACT if dtype == torch.float32 else precision_for(dtype)
    got = ti.chunk_intra(f["q"], f["k"], f["g"], f["beta"], 0.4, c["slots"], c["A_log"], c["dt_bias"], c["opts"], prec)
    ref = oracle.chunk_intra(p["q"], p["k"], p["g"], p["beta"], 0.4, c["slots"], BT)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp16: Qt, Kend and Kt are stored in bf16
    used = _used(c["slots"])
    for name, a, b in zip(("Mqk", "Mkk", "Qt", "Kend", "Kt"), got[:5], (*ref[:4], _kt(c))):
        assert_rel(a, b, 1e-5 if name.startswith("M") else tol, name)
    assert_rel(got[5][used], ref[4][used], 1e-5, "Gam_last")  # the gate in fp32


@pytest.mark.parametrize(
    ("span", "names", "tol"),
    [
        # the factored diagonal blocks switched off: the exact pairwise path
        ("FACTOR_SPAN", ("Mqk", "Mkk"), 1e-6),
        # every chunk flagged for the second (block-path) pass: two fp32 factorings of the same decays
        ("ANCHOR_SPAN", ("Mqk", "Mkk", "Qt", "Kend", "Kt"), 1e-5),
    ],
    ids=["pairwise_path_equals_factored", "block_pass_equals_anchored_pass"],
)
def test_stage_intra_paths_agree(span: str, names: tuple[str, ...], tol: float,
                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Switching a factoring off (its span limit below 0) sends the chunks down the other path: same matrices."""
    c = _stage_case(torch.float32, "normal", "l2norm")
    f = c["flat"]
    args = (f["q"], f["k"], f["g"], f["beta"], 0.4, c["slots"], c["A_log"], c["dt_bias"], c["opts"], EXACT)
    default = ti.chunk_intra(*args)
    monkeypatch.setattr(ti, span, -1.0)
    other = ti.chunk_intra(*args)
    for name, a, b in zip(names, default, other):
        assert_rel(a, b, tol, name)


def test_launch_configuration_caps_tiles_at_the_head_dimension() -> None:
    from kda_ops.triton.chunk_common import LAUNCH, launch

    cfg = launch("solve", BK=100, BV=16)
    assert cfg == {"num_warps": LAUNCH["solve"]["num_warps"], "num_stages": LAUNCH["solve"]["num_stages"],
                   "BK": min(128, LAUNCH["solve"]["BK"]), "BV": 16}  # fmt: skip


@pytest.mark.parametrize(("gates", "option"), [("normal", "plain"), ("reset", "all")])
def test_stage_solve(gates: str, option: str) -> None:
    c = _stage_case(torch.float32, gates, option)
    f, p = c["flat"], c["p"]
    _, Mkk, *_ = oracle.chunk_intra(p["q"], p["k"], p["g"], p["beta"], 0.4, c["slots"], BT)
    got = chunk_solve(Mkk.float(), _kt(c).float(), f["v"], f["beta"], c["slots"], c["opts"], EXACT)
    ref = oracle.chunk_solve(Mkk, p["k"], p["v"], p["g"], p["beta"], c["slots"], BT)
    for name, a, b in zip(("Tm", "W", "U"), got, ref):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize(
    ("gates", "option", "tol"),
    [("normal", "plain", 5e-5), ("normal", "l2norm", 1e-5), ("reset", "all", 1e-5), ("first_row", "l2norm", 1e-5)],
)
def test_stage_prepare(gates: str, option: str, tol: float) -> None:
    """The fused stages 1-3 (``chunk_prepare``) against each stage's float64 oracle in its two uses, every output
    poisoned first: the backward's recompute (``store_tm``: ``Mqk`` in fp32, ``W``, ``U``, ``Qt``, ``Kend``, ``Tm``)
    and the forward's X form (no ``store_tm``: ``Mqk Tb``, ``Kt``, ``Qt``, ``Kb``; neither ``U`` nor ``Tm``). The
    cases take the anchored kernel's two key loops (without l2norm the key tiles load one step ahead); the "reset"
    case with the in-kernel gate flags no chunk (g is the gate's input there), the flagged chunks' block pass is
    tested by the flag-loop test below. K = 70: three key tiles, the last one partial. Without l2norm the keys'
    norms (~8) make the solve ill-conditioned: the staged stages measure the same 1.9e-5 on W as the fused kernel."""
    c = _stage_case(torch.float32, gates, option, K=70)
    f, p = c["flat"], c["p"]
    Mqk, Mkk, Qt, Kend, Gl = oracle.chunk_intra(p["q"], p["k"], p["g"], p["beta"], 0.4, c["slots"], BT)
    Tm, W, U = oracle.chunk_solve(Mkk, p["k"], p["v"], p["g"], p["beta"], c["slots"], BT)
    MqkTb, Kb = oracle.x_form(Mqk, Kend, Tm, p["beta"], c["slots"], BT)
    used = _used(c["slots"])
    folded = c["opts"].use_qk_l2norm and ti_prepare.FOLD_NORMS and ti_prepare.anchored_path_usable(c["opts"])
    for store_tm in (True, False):  # the E form with Tm, the X form
        with poison_outputs():
            got = chunk_prepare(f["q"], f["k"], f["v"], f["g"], f["beta"], 0.4, c["slots"], c["A_log"],
                                c["dt_bias"], c["opts"], EXACT, store_tm=store_tm)  # fmt: skip
        Nrm = got[7]
        assert (Nrm is not None) == folded
        # with the l2norm folded, Qt, Kend (and Kt in the X form) come without their rows' factors: applied here
        nq, nk = (Nrm[0].T[:, :, None], Nrm[1].T[:, :, None]) if Nrm is not None else (1.0, 1.0)
        if store_tm:
            assert got[0].dtype == torch.float32 and got[2] is not None and got[6] is not None
            names, outs, refs = ("Mqk", "W", "U", "Qt", "Kend", "Tm"), (*got[:3], got[3] * nq, got[4] * nk, got[6]), (
                Mqk, W, U, Qt, Kend, Tm)  # fmt: skip
        else:
            assert got[2] is None and got[6] is None
            names, outs, refs = ("Mqk Tb", "Kt", "Qt", "Kb"), (got[0], got[1] * nk, got[3] * nq, got[4]), (
                MqkTb, _kt(c), Qt, Kb)  # fmt: skip
        for name, a, b in zip(names, outs, refs):
            assert_rel(a, b, tol, f"{name} ({'recompute' if store_tm else 'X form'})")
        assert_rel(got[5][used], Gl[used], 1e-5, "Gam_last")


@pytest.mark.parametrize("gates", ["reset", "strong"])
def test_block_pass_flag_loop_over_blocks_and_programs(gates: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block pass after the anchored kernel reads the flags FLAG_BLOCK at a time: with 2 per block, the 14
    (slot, head) items of the stage case (two empty slots) span 7 blocks over the 4 programs the launch uses off
    CUDA. Log decays given as such (no in-kernel gate) flag slots 0, 1 and 4 with hard resets, slots 1 and 4 with
    strong decay, so program 0 walks two blocks and blocks hold two flagged items. Every output against the float64
    oracle, poisoned first (a flagged chunk left undone stays NaN)."""
    monkeypatch.setattr(ti_prepare, "FLAG_BLOCK", 2)
    assert ti_prepare.persistent_programs(torch.device("cpu")) == 4
    test_stage_prepare(gates, "l2norm", 1e-5)


def test_programmatic_dependent_launch_only_where_supported() -> None:
    """Off CUDA (and under the interpreter) the forward's kernels launch plainly; the toolkit gate reads versions."""
    from kda_ops.triton import chunk_common

    assert dict(chunk_common.pdl(torch.device("cpu"))) == {"PDL": False}
    assert chunk_common.cuda_version("13.0") >= (12, 4) and chunk_common.cuda_version("12.4") >= (12, 4)
    assert chunk_common.cuda_version("12.1") < (12, 4) and chunk_common.cuda_version(None) < (12, 4)
    assert chunk_common.cuda_version("abc") == ()


@pytest.mark.parametrize("entry", [1.0, -0.3], ids=["alternating_inverse", "growing_inverse"])
def test_stage_solve_ill_conditioned(entry: float) -> None:
    """The doubling solve on chunks whose every ``Mkk`` entry below the diagonal is ``entry``: with 1.0 (identical
    unit keys, beta 1, no decay) the Neumann terms reach C(62, 31) ~ 1e17 while the inverse holds 0 and +-1 (a
    power series would lose everything to cancellation); with -0.3 the inverse grows to 1.3^62 ~ 1e7. Against the
    float64 inverse of each chunk's (partial) block."""
    c = _stage_case(torch.float32)
    f, slots = c["flat"], c["slots"]
    T, HV = f["v"].shape[0], f["v"].shape[1]
    Mkk = torch.zeros(T, HV, BT, dtype=F64)
    ref = torch.zeros(T, HV, BT, dtype=F64)
    for start, count in zip(slots.start.tolist(), slots.count.tolist()):
        if count == 0:
            continue
        N = torch.tril(torch.full((count, count), entry, dtype=F64), diagonal=-1)
        Mkk[start : start + count, :, :count] = N[:, None, :]
        ref[start : start + count, :, :count] = torch.linalg.inv(torch.eye(count, dtype=F64) + N)[:, None, :]
    Tm, _, _ = chunk_solve(Mkk.float(), _kt(c).float(), f["v"], f["beta"], slots, c["opts"], EXACT)
    assert_rel(Tm, ref, 1e-5, "Tm")


def _factors(c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The float64 oracle's per-chunk factors of a stage case (the inputs of the scan and the output stages)."""
    p = c["p"]
    Mqk, Mkk, Qt, Kend, Gl = oracle.chunk_intra(p["q"], p["k"], p["g"], p["beta"], 0.4, c["slots"], BT)
    Tm, W, U = oracle.chunk_solve(Mkk, p["k"], p["v"], p["g"], p["beta"], c["slots"], BT)
    MqkTb, Kb = oracle.x_form(Mqk, Kend, Tm, p["beta"], c["slots"], BT)
    return {"Mqk": Mqk, "Qt": Qt, "Kend": Kend, "Gl": Gl, "W": W, "U": U, "MqkTb": MqkTb, "Kb": Kb, "Kt": _kt(c),
            "V": p["v"]}  # fmt: skip


@pytest.mark.parametrize("x_form", [False, True], ids=["E_form", "X_form"])
@pytest.mark.parametrize("tiles", [None, 16])
def test_stage_state_and_output(tiles: int | None, x_form: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan alone (states and errors stored) and the output stage on its results. In the X form (the
    forward's: ``Kt, V, Kb`` in, ``X`` out, ``Mqk Tb`` to the output stage) the states, the final state and the
    outputs are those of the E form's oracle, and ``X`` that of the oracle scan on the X form's factors."""
    monkeypatch.setattr(ts, "BV_OVERRIDE", tiles)
    c = _stage_case(torch.float32, "reset", "l2norm", V=24)
    fa = _factors(c)
    N, HV, K, V = len(CU) - 1, 2, 20, 24
    h0 = make_state(N, HV, K, V)
    Hin_r, E_r, final_r = oracle.chunk_state(fa["W"], fa["U"], fa["Kend"], fa["Gl"], h0.double(), c["slots"], BT)
    o_r = oracle.chunk_output(fa["Qt"], fa["Mqk"], Hin_r, E_r, c["slots"], BT)
    if x_form:
        E_r = oracle.chunk_state(fa["Kt"], fa["V"], fa["Kb"], fa["Gl"], h0.double(), c["slots"], BT)[1]
    W, U, Kend, Mqk = ("Kt", "V", "Kb", "MqkTb") if x_form else ("W", "U", "Kend", "Mqk")
    f32 = {n: t.float() for n, t in fa.items()}
    final = torch.empty(N, HV, K, V)
    Hin, E = ts.chunk_state(f32[W], f32[U], f32[Kend], f32["Gl"], h0, c["cu"], EXACT, final=final, x_form=x_form)
    used = _used(c["slots"])
    assert_rel(Hin[used], Hin_r[used], 1e-5, "Hin")
    assert_rel(E, E_r, 1e-5, "X" if x_form else "E")
    assert_rel(final, final_r, 1e-5, "final")
    assert torch.equal(final[1], h0[1]), "an empty sequence keeps its initial state"
    o = chunk_output(f32["Qt"], f32[Mqk], Hin, E, c["slots"], EXACT, torch.float32)
    assert_rel(o, o_r, 1e-5, "o (output stage)")


# ---------------------------------------------------------------------------------------------- pipeline


def _case(name: str, B: int, T: int, H: int, K: int, V: int, HV: int, dtype: torch.dtype = torch.float32,
          gates: str = "normal", seed: int = 0) -> dict[str, Any]:  # fmt: skip
    make_opts, call_opts = OPTIONS[name]
    x = make_inputs(B, T, H, K, V, HV=HV, dtype=dtype, seed=seed, **make_opts)
    _set_gates(x, gates)
    x.update(call_opts)
    return x


def _double(x: dict[str, Any]) -> dict[str, Any]:
    return {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in x.items()}


def _compare(x: dict[str, Any], *, h0: torch.Tensor | None = None, cu: torch.Tensor | None = None, final: bool = True,
             tol: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``chunk_kda`` on the Triton path against the float64 naive recurrence.

    Tolerance ``tol``, or (from data) 1e-5 or twice the error of the fp32 reference chunk kernel on the same
    inputs, whichever is larger: without l2norm the keys are long and the solve ill-conditioned for any fp32 code.
    """
    o, s = kda_ops.chunk_kda(**x, initial_state=h0, cu_seqlens=cu, output_final_state=final)
    h0d = None if h0 is None else h0.double()
    o_ref, s_ref = naive_recurrent_kda(**_double(x), initial_state=h0d, cu_seqlens=cu, output_final_state=final)
    limits = {"o": tol, "final_state": tol}
    if tol is None:
        with ops.cpu_backend("reference"):
            o32, s32 = kda_ops.chunk_kda(**x, initial_state=h0, cu_seqlens=cu, output_final_state=final)
        limits = {"o": max(1e-5, 2 * rel_err(o32, o_ref))}
        if final:
            assert s32 is not None and s_ref is not None
            limits["final_state"] = max(1e-5, 2 * rel_err(s32, s_ref))
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    assert_rel(o, o_ref, limits["o"], "o")  # type: ignore[arg-type]
    if final:
        assert s is not None and s_ref is not None
        assert s.dtype == (F64 if x["v"].dtype == F64 else torch.float32)
        assert_rel(s, s_ref, limits["final_state"], "final_state")  # type: ignore[arg-type]
    else:
        assert s is None
    return o, s


@pytest.mark.parametrize("name", OPTIONS)
def test_forward_every_option(name: str) -> None:
    x = _case(name, 2, 70, 1, 16, 16, HV=2)
    _compare(x, h0=make_state(2, 2, 16, 16))


@pytest.mark.parametrize("T", [1, 63, 64, 65, 128])
def test_forward_lengths(T: int) -> None:
    x = _case("l2norm", 1, T, 1, 16, 16, HV=1)
    _compare(x, h0=make_state(1, 1, 16, 16), tol=1e-5)


def test_forward_varlen_gva_odd_dims() -> None:
    """Packed sequences with an empty and a one-token sequence, grouped value heads, K and V not powers of two."""
    cu = torch.tensor(CU, dtype=torch.int32)
    x = _case("all", 1, CU[-1], 1, 20, 12, HV=2)
    h0 = make_state(len(CU) - 1, 2, 20, 12)
    _, s = _compare(x, h0=h0, cu=cu, tol=1e-5)
    assert s is not None
    assert torch.equal(s[1], h0[1]), "an empty sequence keeps its initial state"


@pytest.mark.parametrize("gates", ["reset", "zero", "strong"])
def test_forward_extreme_gates(gates: str) -> None:
    """Hard resets (g = -1000), no decay, and blocks beyond the factored span: nothing overflows or leaks."""
    cu = torch.tensor(CU, dtype=torch.int64)
    x = _case("l2norm", 1, CU[-1], 1, 16, 16, HV=2, gates=gates)
    _compare(x, h0=make_state(len(CU) - 1, 2, 16, 16), cu=cu, tol=1e-5)


def test_forward_fp16() -> None:
    """fp16 inputs compute in fp32 and store the per-chunk factors in bf16 (range-safe): bf16-level error."""
    x = _case("all", 1, 100, 1, 16, 16, HV=2, dtype=torch.float16)
    _compare(x, h0=make_state(1, 2, 16, 16), tol=1e-2)


def test_forward_fp64_exact() -> None:
    x = _case("all", 1, 80, 1, 12, 10, HV=2, dtype=F64, gates="reset")
    _compare(x, h0=make_state(1, 2, 12, 10, dtype=F64), tol=1e-11)


def test_forward_no_state() -> None:
    x = _case("l2norm", 2, 40, 1, 16, 16, HV=1)
    _compare(x, final=False, tol=1e-5)


def test_forward_tiled_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ts, "BV_OVERRIDE", 16)
    x = _case("all", 1, 70, 1, 16, 40, HV=2)
    _compare(x, h0=make_state(1, 2, 16, 40), tol=1e-5)


def test_staged_pipeline_equals_fused() -> None:
    cu = torch.tensor(CU, dtype=torch.int64)
    x = _case("all", 1, CU[-1], 1, 20, 12, HV=2, gates="reset")
    h0 = make_state(len(CU) - 1, 2, 20, 12)
    o_ref, s_ref = naive_recurrent_kda(**_double(x), initial_state=h0.double(), cu_seqlens=cu, output_final_state=True)
    assert s_ref is not None
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, h0, cu, x["A_log"], x["dt_bias"], _opts(x), True)
    o_ref, s_ref = reference.chunk_fwd(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                         for a in args])  # fmt: skip
    for fn in (tc.chunk_fwd, tc.chunk_fwd_staged):
        o, s = fn(*args)
        assert_rel(o, o_ref, 1e-5, f"{fn.__name__} o")
        assert_rel(s, s_ref, 1e-5, f"{fn.__name__} final")


def test_chunk_equals_recurrent_kernel() -> None:
    """The two Triton schedules compute one function."""
    x = _case("all", 2, 50, 1, 16, 16, HV=2)
    h0 = make_state(2, 2, 16, 16)
    o_c, s_c = kda_ops.chunk_kda(**x, initial_state=h0, output_final_state=True)
    o_r, s_r = kda_ops.recurrent_kda(**x, initial_state=h0, output_final_state=True)
    assert s_c is not None and s_r is not None
    assert_rel(o_c, o_r, 1e-5, "o")
    assert_rel(s_c, s_r, 1e-5, "final_state")


def test_kernel_entry_matches_reference_kernel() -> None:
    """``KERNELS["chunk"]`` has the reference kernel's signature and results; no final state gives ``(0,)``."""
    x = make_inputs(2, 20, 1, 8, 8, HV=2)
    x["g"] = F.logsigmoid(torch.randn(x["g"].shape, generator=torch.Generator().manual_seed(5)))
    opts = Options(use_qk_l2norm=True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, make_state(2, 2, 8, 8), None, None, None, opts, True)
    o, s = KERNELS["chunk"](*args)
    o_ref, s_ref = reference.chunk_fwd(*args)
    assert_rel(o, o_ref, 1e-5)
    assert_rel(s, s_ref, 1e-5)
    o, s = KERNELS["chunk"](*args[:-1], False)
    assert s.shape == (0,)


def test_warmup_is_public_and_a_noop_on_the_cpu() -> None:
    x = _case("l2norm", 1, 8, 1, 8, 8, HV=1)
    assert "warmup" in kda_ops.__all__
    kda_ops.warmup(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True)


def test_warmup_passes_each_function_only_its_own_options() -> None:
    """``kda_ops.warmup`` takes ``chunk_kda``'s keyword options and hands ``recurrent_kda`` and the serving step
    those each accepts: every option of ``chunk_kda`` is one of theirs or left out by name."""
    import inspect

    from kda_ops import tuning

    def options(fn: Any) -> set[str]:
        return {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}

    chunk = options(kda_ops.chunk_kda)
    assert chunk - set(tuning._CHUNK_ONLY) == options(kda_ops.recurrent_kda)
    assert chunk - set(tuning._NOT_SERVING) == options(kda_ops.recurrent_kda_update_)


@pytest.mark.parametrize(("B", "T"), [(1, 1), (1, 64), (2, 63), (3, 65), (7, 130), (2, 1000), (3, 40000)])
def test_dense_slot_map_equals_the_torch_map(B: int, T: int) -> None:
    """The one-launch map of a dense batch (several programs at T = 40000) equals ``varlen.chunk_map``'s, and with
    ``cu_seqlens`` the drivers take ``varlen.chunk_map`` itself."""
    from kda_ops.triton.chunk_map import slot_map
    from kda_ops.varlen import chunk_map

    got = slot_map(None, B, T, torch.device("cpu"))
    ref = chunk_map(None, B, T, BT, torch.device("cpu"))
    for name in ("cu", "start", "count", "offset"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    cu = torch.tensor([0, 5, 5, B * T])
    got = slot_map(cu, B, T, torch.device("cpu"))
    ref = chunk_map(cu, B, T, BT, torch.device("cpu"))
    assert all(torch.equal(getattr(got, n), getattr(ref, n)) for n in ("cu", "start", "count", "offset"))
