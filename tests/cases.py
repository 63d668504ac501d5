"""The cases the test files share: the in-kernel options, the packed (varlen) layouts, the decay patterns, the
acceptance bounds of the GPU tests, and the small helpers that turn them into inputs.

Nothing here imports triton: the files that run without it (the reference, the ops, the public API) use it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kda_ops.common import Options
from kda_ops.testing import make_inputs

F64 = torch.float64
BF16 = torch.bfloat16

# ------------------------------------------------------------------------------------------------ options

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
    "neg_eigval_no_sigmoid": ({}, {"allow_neg_eigval": True}),
    "all": (
        {"gate_in_kernel": True, "beta_logits": True},
        {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
         "allow_neg_eigval": True},
    ),  # fmt: skip
}

# The options each suite runs every test of (the chunk kernels take the recurrent's list but for the one case that
# only the recurrent kernel has a separate branch for: a doubled beta without the sigmoid).
RECURRENT_OPTIONS = list(OPTIONS)
CHUNK_OPTIONS = [name for name in OPTIONS if name != "neg_eigval_no_sigmoid"]
# the recurrent kernels on the GPU (the chunk kernels' list: the doubled beta without the sigmoid is interpreted only)
RECURRENT_GPU_OPTIONS = CHUNK_OPTIONS
# the GPU backward's (each compiles the whole backward for its flags: a subset)
CHUNK_BWD_GPU_OPTIONS = ["plain", "l2norm", "gate", "lower_bound", "lower_bound_no_A", "neg_eigval", "all"]
# the reference backward against autograd of the naive recurrence
REFERENCE_BWD_OPTIONS = ["plain", "l2norm", "gate", "lower_bound", "lower_bound_no_A", "neg_eigval"]


def options(call: dict[str, Any]) -> Options:
    """The :class:`~kda_ops.common.Options` of public-function keyword options ``call``."""
    return Options(
        call.get("use_qk_l2norm_in_kernel", False),
        call.get("use_gate_in_kernel", False),
        call.get("use_beta_sigmoid_in_kernel", False),
        call.get("allow_neg_eigval", False),
        call.get("lower_bound"),
    )


def option_inputs(name: str, B: int, T: int, H: int, K: int, V: int, *, HV: int, dtype: torch.dtype = torch.float32,
                  seed: int = 0, device: str | torch.device = "cpu") -> dict[str, Any]:  # fmt: skip
    """Keyword arguments of a public-function call with option ``name``: the inputs of ``make_inputs`` and the
    options (``A_log=None`` or ``dt_bias=None`` where the option leaves them out)."""
    make_opts, call_opts = OPTIONS[name]
    x = make_inputs(B, T, H, K, V, HV=HV, dtype=dtype, seed=seed, device=device, **make_opts)
    x.update(call_opts)
    return x


def unit_qk(x: dict[str, Any], names: Sequence[str] = ("q", "k"), via: torch.dtype = torch.float32) -> None:
    """Unit-norm ``names`` (in place, normalised in ``via``, stored in their dtype) for a call without the
    in-kernel l2norm: long keys make the delta rule's solve ill-conditioned for any fp32 code, which would test the
    inputs rather than the kernels."""
    for n in names:
        x[n] = F.normalize(x[n].to(via), dim=-1).to(x[n].dtype)


def double(x: dict[str, Any]) -> dict[str, Any]:
    """``x`` with every floating tensor in float64 (the oracle's inputs)."""
    return {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in x.items()}


# ---------------------------------------------------------------------------------------- varlen layouts

# packed sequences of 5, 0, 65 (a full chunk and one token), 1 and 57 tokens: 7 slots, 5 of them used
CU_STAGES = [0, 5, 5, 70, 71, 128]
# packed sequences of 5, 0, 65 (a full chunk and one token), 1 and 9 tokens: 6 slots, 5 of them used
CU_BWD = [0, 5, 5, 70, 71, 80]
# sequences of 7, 0, 3 and 1 chunks (the last partial): the split scans' segments of 1 to 4 chunks, empty ones at 4
# segments
CU_SPLIT = [0, 448, 448, 640, 670]
# the recurrent kernels: empty sequences inside and at the end; at the start and inside
CU_RECURRENT = [0, 4, 4, 11, 11]
CU_RECURRENT_BWD = [0, 0, 9, 9, 14]
# the reference: empty sequences first and inside, a one-token sequence; a short batch for the backward
CU_REFERENCE = [0, 0, 1, 20, 20, 45, 60]
CU_REFERENCE_BWD = [0, 5, 5, 30, 37]
# the GPU tests: empty and one-token sequences, partial chunks, a long tail
CU_GPU_CHUNK = [0, 0, 1, 1, 64, 65, 1000, 1003, 4096]
CU_GPU_RESETS = [0, 5, 5, 700, 701, 2000]
CU_GPU_PARTIAL = [0, 70, 70, 131, 131]
CU_GPU_BWD = [0, 1, 1, 300, 364, 365, 1000]
CU_GPU_RECURRENT = [0, 0, 37, 37, 100, 101, 160]
CU_GPU_SYNC = [0, 20, 20, 50]

# ---------------------------------------------------------------------------------------- decay patterns

GATES = ("normal", "reset", "half_reset", "first_row", "zero", "strong")


def hard_reset(g: torch.Tensor, tokens: Sequence[int], half: int | None = None) -> None:
    """g = -1000 (in place) at ``tokens`` (those inside the sequence) on every channel, and at token ``half`` on
    the first half of the channels."""
    T = g.shape[1]
    g[:, [t for t in tokens if t < T]] = -1000.0
    if half is not None:
        g[:, half, :, : g.shape[-1] // 2] = -1000.0


def set_gates(g: torch.Tensor, gates: str) -> None:
    """Decay patterns of ``g [B, T, HV, K]`` (in place): ``normal`` (as made: logsigmoid(randn)), ``reset`` (hard
    resets: g = -1000 at a few tokens, on every channel or on half of them), ``half_reset`` (at one token, in half
    the channels only: one chunk's key tiles then take different paths), ``first_row`` (hard resets on the first
    row of chunks only), ``zero`` (no decay), ``strong`` (-4.5 per token: every 16-row block spans 72 nats, beyond
    the factored products, without a reset)."""
    assert gates in GATES, gates
    T = g.shape[1]
    if gates == "reset":
        hard_reset(g, (3, 20, 64, 66, 100), 40 % T)
    elif gates == "half_reset":
        hard_reset(g, (), 100 % T)
    elif gates == "first_row":
        hard_reset(g, (5, 69, 71))  # row 0 of a chunk: the anchored path keeps it
    elif gates == "zero":
        g.zero_()
    elif gates == "strong":
        g.fill_(-4.5)


# ------------------------------------------------------------------------------------------ tolerances

# acceptance bounds of the GPU tests, relative error against the float64 oracle: the chunk forward, the chunk
# backward, the recurrent kernels
CHUNK_TOL = {torch.float32: 1e-4, BF16: 5e-3, torch.float16: 5e-3}
CHUNK_GRAD_TOL = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dA_log": 2e-2,
                  "ddt_bias": 2e-2}  # fmt: skip
RECURRENT_TOL = {torch.float32: 1e-5, BF16: 2e-3}
RECURRENT_GRAD_TOL = {torch.float32: 1e-5, BF16: 5e-3}


def assert_compiles_like_eager(step: Any, leaves: list[torch.Tensor]) -> None:
    """``torch.compile(step, fullgraph=True)`` is one graph and gives eager's loss and gradients to ``leaves``."""
    from torch._dynamo.testing import CompileCounterWithBackend

    loss = step(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    loss_c = compiled(*leaves)
    grads_c = torch.autograd.grad(loss_c, leaves)
    assert counter.frame_count == 1
    torch.testing.assert_close(loss_c, loss)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------ layouts


def batch_transposed(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, stored time-major: ``[B, T, ...]`` with strides of a transposed ``[T, B, ...]``."""
    dims = (1, 0, *range(2, t.dim()))
    return t.permute(dims).contiguous().permute(dims)


def state_transposed(s: torch.Tensor) -> torch.Tensor:
    """``s``'s values, stored with its last two dimensions swapped."""
    return s.transpose(-1, -2).contiguous().transpose(-1, -2)
