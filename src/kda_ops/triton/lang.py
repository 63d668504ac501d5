"""The ``@triton.jit`` helpers that every kernel family shares: products at a named precision, programmatic
dependent launch, and the input transforms of the public contract (the gate, beta, the l2norm factor), each with the
formula of :mod:`kda_ops.reference.inputs`."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """The first statement of a kernel launched with :func:`pdl`: wait for the kernel before it on the stream to
    complete (its writes visible), then let the next one launch. Nothing is read or written before the wait."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def mm(a, b, PREC: tl.constexpr, DT: tl.constexpr):
    """``a @ b`` (2-D, or 3-D batched) accumulated in ``DT``, operands at precision ``PREC``."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16)).to(DT)
    else:
        return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def rnorm(ss):
    """The l2norm factor ``1 / sqrt(ss + 1e-6)`` of rows whose sums of squares are ``ss`` (``reference/gates.py``)."""
    return 1.0 / tl.sqrt(ss + 1e-6)


@triton.jit
def beta_value(x, USE_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """``sigmoid(x)`` when asked, times 2 with negative eigenvalues (``reference/gates.py``)."""
    if USE_SIGMOID:
        x = 1.0 / (1.0 + tl.exp(-x))
    if NEG_EIGVAL:
        x = x * 2.0
    return x


@triton.jit
def softplus(x):
    # torch's softplus (threshold 20) to rounding; exp(x) alone where log(1 + exp(x)) would round to 0
    return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))


@triton.jit
def gate(x, mask, A_log, dt_bias, o_k, m_k, i_hv, lower_bound, K: tl.constexpr, USE_GATE: tl.constexpr,
         USE_A: tl.constexpr, USE_BIAS: tl.constexpr, USE_BOUND: tl.constexpr, DT: tl.constexpr):
    """:func:`load_log_decay` after the load: ``x [BT, BK]`` as loaded (0 outside ``mask``) to the log decay."""
    x = x.to(DT)
    if USE_GATE:
        if USE_BIAS:
            x = x + tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(DT)[None, :]
        if USE_BOUND:
            if USE_A:
                x = x * tl.exp(tl.load(A_log + i_hv).to(DT))
            x = lower_bound * (1.0 / (1.0 + tl.exp(-x)))
        else:
            x = -tl.exp(tl.load(A_log + i_hv).to(DT)) * softplus(x)
        x = tl.where(mask, x, 0.0)
    return x
