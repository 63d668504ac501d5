"""``chunk_kda(..., return_intermediate_states=True)``: the state entering each chunk, dense and packed, against the
float64 recurrence run to each chunk boundary, on the reference and the Triton kernels; its op traced and checked
by ``torch.library.opcheck``; refused under autograd."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import kda_ops
from kda_ops import ops
from kda_ops.reference.naive import naive_recurrent_kda
from kda_ops.testing import assert_rel, make_inputs, make_state

C = 64
PATHS = [pytest.param("reference", id="reference"),
         pytest.param("triton", marks=pytest.mark.interpret, id="interpret")]  # fmt: skip
CU = [0, 70, 70, 200]  # 2, 0 and 3 chunks


@contextlib.contextmanager
def on(path: str) -> Iterator[None]:
    with ops.cpu_backend(path):
        yield


def boundary_states(x: dict[str, torch.Tensor], h0: torch.Tensor, bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The float64 state entering each chunk of each sequence ``(start, end)`` of the flat rows of ``x``."""
    out = []
    for n, (a, b) in enumerate(bounds):
        for c in range(-(-(b - a) // C)):
            if c == 0:
                out.append(h0[n].double())
                continue
            part = {k: t[:, a : a + c * C].double() for k, t in x.items()}
            _, s = naive_recurrent_kda(**part, initial_state=h0[n : n + 1].double(), output_final_state=True)
            assert s is not None
            out.append(s[0])
    return out


@pytest.mark.parametrize("path", PATHS)
def test_dense(path: str) -> None:
    B, T, H, K, V = 2, 150, 1, 16, 16
    x = make_inputs(B, T, H, K, V, HV=2, seed=3)
    x = {k: x[k] for k in ("q", "k", "v", "g", "beta")}
    h0 = make_state(B, 2, K, V)
    with on(path), torch.no_grad():
        o, final, h = kda_ops.chunk_kda(**x, initial_state=h0, output_final_state=True,
                                        return_intermediate_states=True)  # fmt: skip
        o2, final2 = kda_ops.chunk_kda(**x, initial_state=h0, output_final_state=True)
    assert h.shape == (B, 3, 2, K, V) and h.dtype == torch.float32
    assert torch.equal(o, o2) and final is not None and final2 is not None and torch.equal(final, final2)
    for b in range(B):
        ref = boundary_states({k: t[b : b + 1] for k, t in x.items()}, h0[b : b + 1], [(0, T)])
        assert_rel(h[b], torch.stack(ref), 1e-5, f"states of sequence {b}")


@pytest.mark.parametrize("path", PATHS)
def test_packed(path: str) -> None:
    T, H, K, V = CU[-1], 1, 16, 16
    x = make_inputs(1, T, H, K, V, HV=2, seed=4)
    x = {k: x[k] for k in ("q", "k", "v", "g", "beta")}
    h0 = make_state(len(CU) - 1, 2, K, V)
    cu = torch.tensor(CU)
    with on(path), torch.inference_mode():
        _, _, h = kda_ops.chunk_kda(**x, initial_state=h0, cu_seqlens=cu, return_intermediate_states=True)
    used = sum(-(-(b - a) // C) for a, b in zip(CU, CU[1:]))
    assert h.shape == (1, -(-T // C) + len(CU) - 1, 2, K, V)
    ref = boundary_states(x, h0, list(zip(CU, CU[1:])))
    assert_rel(h[0, :used], torch.stack(ref), 1e-5, "states")
    assert not h[0, used:].any(), "the slots past the last chunk are zero"


def test_bf16_states_are_bf16() -> None:
    x = make_inputs(1, 64, 1, 16, 16, dtype=torch.bfloat16, seed=5)
    with torch.no_grad():
        _, _, h = kda_ops.chunk_kda(*(x[k] for k in ("q", "k", "v", "g", "beta")), return_intermediate_states=True)
    assert h.dtype == torch.bfloat16 and h.shape == (1, 1, 1, 16, 16)
    assert not h.any(), "no initial state: the first chunk starts from zeros"


def test_refused_under_autograd() -> None:
    x = make_inputs(1, 64, 1, 16, 16, seed=6)
    q = x["q"].requires_grad_()
    with pytest.raises(ValueError, match="return_intermediate_states"):
        kda_ops.chunk_kda(q, x["k"], x["v"], x["g"], x["beta"], return_intermediate_states=True)


def test_opcheck() -> None:
    x = make_inputs(1, 100, 1, 16, 16, seed=7)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.25, None, torch.tensor([0, 30, 100]), None, None, None,
            True, False, False, False, False)  # fmt: skip
    torch.library.opcheck(torch.ops.kda.chunk_states.default, args)
