"""The ``@triton.jit`` helpers that every kernel family shares: products at a named precision, programmatic
dependent launch, and the input transforms of the public contract (the gate, beta, the l2norm factor), each with the
formula of :mod:`kda_ops.reference.inputs`."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kda_ops.common import L2NORM_EPS, LOG_DECAY_FLOOR


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """The first statement of a kernel launched with :func:`pdl`: wait for the kernel before it on the stream to
    complete (its writes visible), then let the next one launch. Nothing is read or written before the wait."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# The bits of an fp32 value that TF32 keeps (sign, exponent, 10 of the 23 mantissa bits), and half a unit of the
# last of them (added before the mask, it rounds to nearest).
TF32_MASK = tl.constexpr(-(1 << 13))
TF32_HALF = tl.constexpr(1 << 12)
# The exponent bits of an fp32 value: all set in an infinity or a NaN.
EXP_MASK = tl.constexpr(0x7F800000)


@triton.jit
def tf32_nearest(x):
    """``x`` (fp32) rounded to the nearest TF32 value, ties away from zero: the tensor cores cut an fp32 operand to
    TF32 toward zero, which biases every product of a chain the same way. A 16-bit ``x``, exact in TF32, is only
    widened. Infinities and NaNs pass unchanged (the carry of the rounding would turn a NaN into a zero or an
    infinity); a finite value within half a TF32 unit of fp32's largest rounds to infinity, as rounding to nearest
    does."""
    if x.dtype == tl.float32:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + TF32_HALF) & TF32_MASK).to(tl.float32, bitcast=True)
        return tl.where((bits & EXP_MASK) == EXP_MASK, x, rounded)
    else:
        return x.to(tl.float32)


@triton.jit
def mm(a, b, PREC: tl.constexpr, DT: tl.constexpr):
    """``a @ b`` (2-D, or 3-D batched) accumulated in ``DT``, operands at precision ``PREC``.

    ``"tf32x2"``: for an ``a`` that TF32 holds exactly (values stored in 16 bits), ``b`` split into the part TF32
    keeps and the rest, two TF32 products into one accumulator: ``b``'s rounding drops from ``2^-10`` to ``~2^-20``
    relative (TF32 cut toward zero), for two thirds of the products of ``"tf32x3"``, which splits both operands.
    A finite ``b`` only: an infinity's rest is NaN.

    ``"tf32rn"``: TF32 with fp32 operands rounded to nearest first (:func:`tf32_nearest`), unbiased."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16)).to(DT)
    elif PREC == "tf32rn":
        return tl.dot(tf32_nearest(a), tf32_nearest(b), input_precision="tf32").to(DT)
    elif PREC == "tf32x2":
        bf = b.to(tl.float32)
        hi = (bf.to(tl.int32, bitcast=True) & TF32_MASK).to(tl.float32, bitcast=True)
        af = a.to(tl.float32)
        return tl.dot(af, hi, tl.dot(af, bf - hi, input_precision="tf32"), input_precision="tf32").to(DT)
    else:
        return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def stack_rows(a, b):
    """``[a; b]``: two tiles of one shape ``[R, C]`` stacked along the rows, ``[2 R, C]``."""
    R: tl.constexpr = a.shape[0]
    C: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * R, C))


@triton.jit
def split_rows(x):
    """The halves ``x[:R], x[R:]`` of a ``[2 R, C]`` tile (:func:`stack_rows` undone)."""
    R: tl.constexpr = x.shape[0] // 2
    C: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, (2, R, C)), (1, 2, 0)))


# The l2norm of q and k: x / sqrt(sum(x * x) + EPS), as in the reference.
EPS = tl.constexpr(L2NORM_EPS)


# The smallest log decay the kernels use (-inf, a hard reset, to it), as in the reference.
LOG_FLOOR = tl.constexpr(LOG_DECAY_FLOOR)


@triton.jit
def rnorm(ss):
    """The l2norm factor ``1 / sqrt(ss + EPS)`` of rows whose sums of squares are ``ss``."""
    return 1.0 / tl.sqrt(ss + EPS)


@triton.jit
def l2norm_bwd(y, r, dy, AXIS: tl.constexpr):
    """Gradient of ``y = x r`` (the l2norm along ``AXIS``, ``r`` its factor, broadcast against ``y``) to ``x``:
    ``r (dy - y (y . dy))``, linear in ``dy``."""
    return r * (dy - y * tl.sum(y * dy, axis=AXIS, keep_dims=True))


@triton.jit
def beta_value(x, USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """``sigmoid(x)`` when asked, times 2 with negative eigenvalues."""
    if USE_BETA_SIGMOID:
        x = 1.0 / (1.0 + tl.exp(-x))
    if NEG_EIGVAL:
        x = x * 2.0
    return x


@triton.jit
def softplus(x):
    """torch's softplus (threshold 20) to rounding; ``exp(x)`` alone where ``log(1 + exp(x))`` would round to 0."""
    return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))


@triton.jit
def log_decay(z, a, lower_bound, HAS_A_LOG: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """The in-kernel gate, from ``z = x + dt_bias`` and ``a = exp(A_log)`` (unused without ``HAS_A_LOG``)::

        g = -a * softplus(z)                    (no lower bound)
        g = lower_bound * sigmoid(a * z)        (``a`` omitted without A_log)
    """
    if USE_LOWER_BOUND:
        if HAS_A_LOG:
            z = z * a
        return lower_bound * (1.0 / (1.0 + tl.exp(-z)))
    else:
        return -a * softplus(z)
