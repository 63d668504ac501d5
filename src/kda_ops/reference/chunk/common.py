"""What the chunk oracles share: the chunk-slot layout, the chunk-local cumulative decay, the pairwise decays.

The stage oracles take the flat token stream (``[T, HV, ...]``: a dense batch ``[B, T]`` flattened, or packed
sequences) and the chunk-slot map of :func:`kda_ops.varlen.chunk_slots`, and return what the matching Triton
launcher in :mod:`kda_ops.triton.chunk` returns: per-token rows (``Mqk``, ``Mkk``, ``Tm``: row ``t`` holds the row
of its chunk, ``C`` columns, zero past the chunk's tokens; ``Qt``, ``Kend``, ``W``, ``U``, ``E``) and per-slot
blocks (``Gam_last``, ``Hin``, ``[NC, HV, ...]``). Inside, tokens are gathered into slots ``[NC, HV, C, ...]``
(:func:`gather`), computed on per slot, and scattered back (:func:`scatter`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from kda_ops.common import CHUNK_SIZE
from kda_ops.transforms import floor_log_decay
from kda_ops.varlen import ChunkSlots

DEFAULT_CHUNK_SIZE = CHUNK_SIZE


def chunk_local_cumsum(g: Tensor) -> Tensor:
    """``Gam [..., C, K]``: cumulative log decay within each chunk (dim -2), of the log decay at least
    ``LOG_DECAY_FLOOR`` (the kernels' ``Gam``)."""
    return torch.cumsum(floor_log_decay(g), dim=-2)


def pairwise_decay(Gam: Tensor, strict: bool) -> Tensor:
    """``exp(Gam_i - Gam_j)`` as ``[..., C, C, K]`` where ``j < i`` (``j <= i`` unless strict), else 0."""
    C = Gam.shape[-2]
    future = torch.ones(C, C, dtype=torch.bool, device=Gam.device).triu(0 if strict else 1)
    diff = Gam.unsqueeze(-2) - Gam.unsqueeze(-3)
    return diff.masked_fill_(future[..., None], float("-inf")).exp_()


# The pairwise decays take C * C * K elements per chunk and head: the products below form them for a block of
# (chunk, head) pairs at a time, at most this many elements (64 MB of fp32), so that the CPU reference's memory does
# not grow with the sequence (B1 T4096 H8 K = V = 128 bf16 forward on one thread: 0.69 GB peak RSS, where the whole
# sequence's decays at once took 3.69 GB). The products are in-place broadcasts and sums, not einsums, whose operand
# copies took a quarter of the time.
PAIRWISE_BLOCK = 2**24


def _blocks(fn: Callable[..., tuple[Tensor, ...]], *xs: Tensor) -> tuple[Tensor, ...]:
    """``fn`` over blocks of the leading dims of ``xs`` (each ``[..., C, X]``), outputs concatenated back."""
    lead = xs[0].shape[:-2]
    C, K = xs[0].shape[-2], xs[0].shape[-1]
    flat = [x.flatten(0, -3) if x.dim() > 2 else x[None] for x in xs]
    step = max(1, PAIRWISE_BLOCK // max(1, C * C * K))
    n = flat[0].shape[0]
    outs = [fn(*(f[i : i + step] for f in flat)) for i in range(0, n, step)] or [fn(*flat)]
    return tuple(torch.cat(o).reshape(*lead, *o[0].shape[1:]) for o in zip(*outs))


def pairwise_product(a: Tensor, b: Tensor, Gam: Tensor, strict: bool) -> Tensor:
    """``X[i, j] = sum_d a_id b_jd exp(Gam_id - Gam_jd)`` (``j < i``, or ``j <= i`` unless strict; else 0):
    ``[..., C, C]`` from ``[..., C, K]`` operands."""

    def block(a: Tensor, b: Tensor, G: Tensor) -> tuple[Tensor]:
        dec = pairwise_decay(G, strict).mul_(a.unsqueeze(-2)).mul_(b.unsqueeze(-3))
        return (dec.sum(-1),)

    return _blocks(block, a, b, Gam)[0]


def pairwise_bwd(a: Tensor, b: Tensor, Gam: Tensor, dX: Tensor, strict: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``X[i,j] = sum_d a_id b_jd exp(Gam_id - Gam_jd)`` (causal) to ``a``, ``b`` and ``Gam``."""

    def block(a: Tensor, b: Tensor, G: Tensor, dX: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        w = pairwise_decay(G, strict).mul_(dX.unsqueeze(-1))  # dX_ij exp(Gam_i - Gam_j), [.., C, C, K]
        da = (w * b.unsqueeze(-3)).sum(-2)
        db = w.mul_(a.unsqueeze(-2)).sum(-3)
        # d/dGam_i of a_i b_j exp(Gam_i - Gam_j) is the term itself, and minus it for Gam_j
        return da, db, a * da - b * db

    da, db, dGam = _blocks(block, a, b, Gam, dX)
    return da, db, dGam


def gather(x: Tensor, index: Tensor) -> Tensor:
    """Flat tokens ``[T, HV, ...]`` to slots ``[NC, HV, C, ...]``; the spare index T gives zeros."""
    xp = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return xp[index].movedim(2, 1)


def scatter(x: Tensor, index: Tensor, T: int) -> Tensor:
    """Slots ``[NC, HV, C, ...]`` back to flat tokens ``[T, HV, ...]`` (each token lives in exactly one slot)."""
    flat = x.movedim(1, 2).flatten(0, 1)
    out = flat.new_zeros(T + 1, *flat.shape[1:]).index_add_(0, index.flatten(), flat)
    return out[:T]


def stack_slots(xs: list[Tensor], item: Sequence[int], like: Tensor) -> Tensor:
    """The per-slot results ``[*item]`` of a scan loop stacked to ``[NC, *item]``; ``[0, *item]`` (``like``'s dtype
    and device) when there are no slots, as with no sequences (B = 0)."""
    return torch.stack(xs) if xs else like.new_zeros(0, *item)


def slot_index(slots: ChunkSlots, C: int, T: int) -> Tensor:
    """``[NC, C]``: the token of each slot row, or the spare index ``T`` where the row is padding."""
    rows = torch.arange(C, device=slots.start.device)
    return torch.where(rows < slots.count[:, None], slots.start[:, None] + rows, T)


def expand_heads(x: Tensor, HV: int) -> Tensor:
    """q or k ``[T, H, K]`` repeated to the value heads ``[T, HV, K]`` (value head ``hv`` reads head ``hv // G``)."""
    return x.repeat_interleave(HV // x.shape[1], dim=1)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "chunk_local_cumsum",
    "expand_heads",
    "gather",
    "pairwise_bwd",
    "pairwise_decay",
    "pairwise_product",
    "scatter",
    "slot_index",
    "stack_slots",
]
