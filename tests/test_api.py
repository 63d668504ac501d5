"""Every malformed input raises TypeError or ValueError naming the argument and what was expected."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kda_ops
from kda_ops.testing import make_inputs, make_state


def _ok() -> dict[str, Any]:
    return make_inputs(1, 8, 2, 4, 4, HV=4)


def _case(**over: Any) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        x = _ok()
        for name, val in over.items():
            x[name] = val(x) if callable(val) else val
        return x

    return build


BAD: dict[str, tuple[Callable[[], dict[str, Any]], type[Exception], str]] = {
    "q not 4-D": (_case(q=lambda x: x["q"][0]), ValueError, "q"),
    "k shape": (_case(k=lambda x: x["k"][:, :7]), ValueError, "k"),
    "v batch": (_case(v=lambda x: torch.cat([x["v"], x["v"]])), ValueError, "v"),
    "g shape": (_case(g=lambda x: x["g"][..., :3]), ValueError, "g"),
    "beta shape": (_case(beta=lambda x: x["beta"][..., None]), ValueError, "beta"),
    "int q": (_case(q=lambda x: x["q"].long()), TypeError, "q"),
    "int beta": (_case(beta=lambda x: x["beta"].int()), TypeError, "beta"),
    "q list": (_case(q=lambda x: x["q"].tolist()), TypeError, "q"),
    "beta list": (_case(beta=lambda x: x["beta"].tolist()), TypeError, "beta"),
    "q/v dtype": (_case(v=lambda x: x["v"].double()), TypeError, "v"),
    "v fp16, q and k fp32": (_case(v=lambda x: x["v"].half()), TypeError, "v"),
    "q/k dtype": (_case(k=lambda x: x["k"].half()), TypeError, "k"),
    "q the odd one out": (_case(k=lambda x: x["k"].half(), v=lambda x: x["v"].half()), TypeError, "q"),
    "HV not multiple": (_case(v=lambda x: x["v"][:, :, :3], g=lambda x: x["g"][:, :, :3],
                              beta=lambda x: x["beta"][:, :, :3]), ValueError, "v"),  # fmt: skip
    "K > 256": (lambda: make_inputs(1, 2, 1, 257, 4), ValueError, "q"),
    "V > 256": (lambda: make_inputs(1, 2, 1, 4, 257), ValueError, "v"),
    "device": (_case(beta=lambda x: x["beta"].to("meta")), ValueError, "beta"),
    "cu float": (_case(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "cu_seqlens"),
    "cu 2-D": (_case(cu_seqlens=torch.tensor([[0, 8]])), ValueError, "cu_seqlens"),
    "cu short": (_case(cu_seqlens=torch.tensor([0])), ValueError, "cu_seqlens"),
    "cu start": (_case(cu_seqlens=torch.tensor([1, 8])), ValueError, "cu_seqlens"),
    "cu end": (_case(cu_seqlens=torch.tensor([0, 7])), ValueError, "cu_seqlens"),
    "cu decreasing": (_case(cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError, "cu_seqlens"),
    "cu with B > 1": (lambda: {**make_inputs(2, 4, 1, 4, 4), "cu_seqlens": torch.tensor([0, 4])}, ValueError,
                      "cu_seqlens"),  # fmt: skip
    "cu wrong length for state": (_case(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=make_state(3, 4, 4, 4)),
                                  ValueError, "initial_state"),  # fmt: skip
    "state shape": (_case(initial_state=make_state(1, 4, 4, 5)), ValueError, "initial_state"),
    "state dtype": (_case(initial_state=torch.zeros(1, 4, 4, 4, dtype=torch.int32)), TypeError, "initial_state"),
    "gate without A_log": (_case(use_gate_in_kernel=True), ValueError, "A_log"),
    "A_log shape": (_case(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, "A_log"),
    "dt_bias shape": (_case(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4)), ValueError,
                      "dt_bias"),  # fmt: skip
    "A_log without gate": (_case(A_log=torch.zeros(4)), ValueError, "A_log"),
    "lower_bound nan": (_case(use_gate_in_kernel=True, lower_bound=float("nan")), ValueError, "lower_bound"),
    "scale tensor": (_case(scale=torch.tensor(0.5)), TypeError, "scale"),
}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
def test_bad_input_names_the_argument(case: str, fn: Callable[..., Any]) -> None:
    build, exc, name = BAD[case]
    with pytest.raises(exc, match=rf"^{re.escape(name)}: expected"):
        fn(**build())


def test_good_input_passes() -> None:
    x = _ok()
    o, s = kda_ops.chunk_kda(**x, cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32), output_final_state=True,
                             initial_state=make_state(2, 4, 4, 4))  # fmt: skip
    assert o.shape == (1, 8, 4, 4) and s is not None and s.shape == (2, 4, 4, 4)


def test_self_check_runs_an_empty_batch(capsys: pytest.CaptureFixture[str]) -> None:
    from kda_ops.__main__ import main

    assert main(["--B", "0", "--T", "8", "--no-compile", "--iters", "1"]) == 0
    assert "OK" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "named"), [(["--HV", "3"], "--HV"), (["--B", "-1"], "--B"), (["--K", "300"], "--K")])
def test_self_check_refuses_a_bad_problem_by_its_flag(flags: list[str], named: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from kda_ops.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--no-compile", "--iters", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err and "Traceback" not in err, err
