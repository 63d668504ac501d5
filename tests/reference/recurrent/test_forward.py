"""``kda_ops.reference.recurrent.forward``: the sync-free recurrent reference against the naive recurrence, in
float64 (the serving step's reference kernel: ``tests/test_serving.py``)."""

from __future__ import annotations

import pytest
import torch

from kda_ops.common import Options
from kda_ops.reference import naive_recurrent_kda, recurrent_fwd
from kda_ops.testing import make_inputs, make_state, rel_err
from tests.cases import CU_REFERENCE, F64


@pytest.mark.parametrize("T", [1, 15, 16, 17, 50])
@pytest.mark.parametrize("HV", [2, 4])
def test_recurrent_matches_naive_float64(T: int, HV: int) -> None:
    x = make_inputs(2, T, 2, 8, 6, HV=HV, dtype=F64, seed=T)
    h0 = make_state(2, HV, 8, 6, dtype=F64)
    o_ref, s_ref = naive_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    assert s_ref is not None
    o2, s2 = recurrent_fwd(**x, scale=8**-0.5, initial_state=h0, cu_seqlens=None, A_log=None, dt_bias=None,
                           opts=Options(), output_final_state=True)  # fmt: skip
    assert rel_err(o2, o_ref) <= 1e-12
    assert rel_err(s2, s_ref) <= 1e-12


def test_recurrent_varlen_empty_and_one_token_sequences() -> None:
    cu = torch.tensor(CU_REFERENCE)
    x = make_inputs(1, 60, 1, 8, 4, HV=2, dtype=F64)
    h0 = make_state(6, 2, 8, 4, dtype=F64)
    o_ref, s_ref = naive_recurrent_kda(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert s_ref is not None
    o, s = recurrent_fwd(**x, scale=8**-0.5, initial_state=h0, cu_seqlens=cu, A_log=None, dt_bias=None,
                         opts=Options(), output_final_state=True)  # fmt: skip
    assert rel_err(o, o_ref) <= 1e-10
    assert rel_err(s, s_ref) <= 1e-10
    assert torch.equal(s[[0, 3]], h0[[0, 3]])  # empty sequences keep their state
