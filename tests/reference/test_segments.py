"""``kda_ops.reference.segments``: a sequence cut into segments anywhere, each segment's affine map combined in
order, gives the states of the plain recurrence (float64)."""

from __future__ import annotations

import pytest
import torch

from kda_ops.common import Options
from kda_ops.reference.chunk.common import gather, slot_index
from kda_ops.reference.chunk.intra import intra
from kda_ops.reference.chunk.prepare import prepare_flat
from kda_ops.reference.chunk.scan import state_scan
from kda_ops.reference.chunk.solve import solve
from kda_ops.reference.naive import naive_recurrent_kda
from kda_ops.reference.segments import chunk_maps, compose, segment_map, segment_states
from kda_ops.testing import make_inputs, make_state
from kda_ops.varlen import chunk_slots

C = 64
T, H, K, V = 9 * C + 17, 2, 8, 6  # 10 chunks, the last partial


def case() -> dict[str, torch.Tensor]:
    """One sequence's chunk factors (``[NC, H, C, *]``) in float64, its inputs and initial state."""
    x = make_inputs(1, T, H, K, V, dtype=torch.float64, seed=5)
    x["g"] = x["g"] / 8  # slow decay: the incoming state of a segment matters to its end
    cu = torch.tensor([0, T])
    slots = chunk_slots(cu, T, C)
    q, k, g, beta = prepare_flat(x["q"][0], x["k"][0], x["g"][0], x["beta"][0], None, None, Options(), torch.float64)
    v = x["v"][0]
    _, Mkk, _, Kend, Gl = intra(q, k, g, beta, 0.5, slots, C)
    _, W, U = solve(Mkk, k, v, g, beta, slots, C)
    index = slot_index(slots, C, T)
    Wc, Uc, Kc = (gather(t, index) for t in (W, U, Kend))
    h0 = make_state(1, H, K, V, dtype=torch.float64, seed=6)
    Hin, _, final = state_scan(Wc, Uc, Kc, Gl, h0, slots)
    n = int(slots.count.gt(0).sum())
    return {"W": Wc[:n], "U": Uc[:n], "Kend": Kc[:n], "Gl": Gl[:n], "h0": h0[0], "Hin": Hin[:n], "final": final[0],
            **{name: x[name] for name in ("q", "k", "v", "g", "beta")}}  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_random_splits(seed: int) -> None:
    """Random cut points: the state entering each segment is the plain scan's at that chunk, and the last segment's
    output the final state of the token recurrence."""
    c = case()
    n = c["W"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: 1 + seed].add(1).tolist())
    bounds = [0, *cuts, n]
    M, B = chunk_maps(c["W"], c["U"], c["Kend"], c["Gl"])
    maps = [segment_map(M[a:b], B[a:b]) for a, b in zip(bounds, bounds[1:])]
    states = segment_states(maps, c["h0"])
    for j, a in enumerate(bounds[:-1]):
        torch.testing.assert_close(states[j], c["Hin"][a], rtol=1e-10, atol=1e-12)
    _, final = naive_recurrent_kda(c["q"], c["k"], c["v"], c["g"], c["beta"], scale=0.5,
                                   initial_state=c["h0"][None], output_final_state=True)  # fmt: skip
    assert final is not None
    torch.testing.assert_close(states[-1], final[0], rtol=1e-10, atol=1e-12)


def test_compose_is_associative() -> None:
    c = case()
    M, B = chunk_maps(c["W"], c["U"], c["Kend"], c["Gl"])
    a, b, d = ((M[i], B[i]) for i in range(3))
    left, right = compose(compose(a, b), d), compose(a, compose(b, d))
    for x, y in zip(left, right):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
