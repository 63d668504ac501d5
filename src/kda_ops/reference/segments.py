"""The affine state map of a segment of chunks and the combine of consecutive segments (``docs/math.md``,
"Segments: the split scan"): the float64 oracle of the split scan in :mod:`kda_ops.triton.chunk.scan`.

Per value head, chunk ``c`` maps its incoming state ``S [K, V]`` to ``M_c S + B_c`` with
``M_c = diag(exp(Gam_last)) - Kend^T W`` and ``B_c = Kend^T U``; a segment's map is the composition of its chunks'.
"""

from __future__ import annotations

from torch import Tensor


def chunk_maps(W: Tensor, U: Tensor, Kend: Tensor, Gl: Tensor) -> tuple[Tensor, Tensor]:
    """Each chunk's map ``(M_c [..., K, K], B_c [..., K, V])`` from its factors ``W, Kend [..., C, K]``,
    ``U [..., C, V]`` and ``Gl [..., K]`` (the E form; the X form's ``Kt, V, Kb`` give the same maps)."""
    Kt = Kend.transpose(-1, -2)
    M = Gl.exp().diag_embed() - Kt @ W
    return M, Kt @ U


def compose(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The map of ``first`` then ``second``: ``(M2 M1, M2 B1 + B2)``."""
    (M1, B1), (M2, B2) = first, second
    return M2 @ M1, M2 @ B1 + B2


def segment_map(M: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """The map of consecutive chunks, ``M [n, ..., K, K]``, ``B [n, ..., K, V]`` (``n >= 1``), in order."""
    acc = (M[0], B[0])
    for c in range(1, M.shape[0]):
        acc = compose(acc, (M[c], B[c]))
    return acc


def segment_states(maps: list[tuple[Tensor, Tensor]], h0: Tensor) -> list[Tensor]:
    """The state entering each segment, and after the last: ``S_in[0] = h0``, ``S_in[j + 1] = M_j S_in[j] + B_j``."""
    states = [h0]
    for M, B in maps:
        states.append(M @ states[-1] + B)
    return states


__all__ = ["chunk_maps", "compose", "segment_map", "segment_states"]
