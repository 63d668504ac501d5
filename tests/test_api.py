"""Every malformed input raises TypeError or ValueError naming the argument and what was expected."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kda_ops
from kda_ops.nn import KDALayer
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
    "lower_bound positive": (_case(use_gate_in_kernel=True, lower_bound=5.0), ValueError, "lower_bound"),
    "lower_bound bool": (_case(use_gate_in_kernel=True, lower_bound=True), TypeError, "lower_bound"),
    "lower_bound str": (_case(use_gate_in_kernel=True, lower_bound="-5"), TypeError, "lower_bound"),
    "lower_bound 1-D tensor": (_case(use_gate_in_kernel=True, lower_bound=torch.tensor([-5.0])), TypeError,
                               "lower_bound"),  # fmt: skip
    # a tensor off the CPU (meta here, cuda on a GPU): reading its value would synchronise with the device
    "lower_bound device tensor": (_case(use_gate_in_kernel=True, lower_bound=torch.tensor(-5.0, device="meta")),
                                  TypeError, "lower_bound"),  # fmt: skip
    "lower_bound positive tensor": (_case(use_gate_in_kernel=True, lower_bound=torch.tensor(2.0)), ValueError,
                                    "lower_bound"),  # fmt: skip
    "scale tensor": (_case(scale=torch.tensor(0.5)), TypeError, "scale"),
    "scale bool": (_case(scale=True), TypeError, "scale"),
    "scale nan": (_case(scale=float("nan")), ValueError, "scale"),
    "scale too large for a float": (_case(scale=10**400), ValueError, "scale"),
    "scale too large to print": (_case(scale=10**5000), ValueError, "scale"),
    "lower_bound too large for a float": (_case(use_gate_in_kernel=True, lower_bound=-(10**400)), ValueError,
                                          "lower_bound"),  # fmt: skip
    "no query heads": (_case(q=lambda x: x["q"][:, :, :0], k=lambda x: x["k"][:, :, :0]), ValueError, "q"),
    "no value heads": (_case(v=lambda x: x["v"][:, :, :0], g=lambda x: x["g"][:, :, :0],
                             beta=lambda x: x["beta"][:, :, :0]), ValueError, "v"),  # fmt: skip
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


FLAGS = ["output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
         "allow_neg_eigval"]  # fmt: skip


@pytest.mark.parametrize("value", ["yes", 1, None, torch.tensor(True)], ids=["str", "int", "None", "tensor"])
@pytest.mark.parametrize("flag", [*FLAGS, "recompute_in_backward"])
@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda, kda_ops.recurrent_kda_update_],
                         ids=["chunk", "recurrent", "update"])  # fmt: skip
def test_a_flag_that_is_not_a_bool_is_named(fn: Callable[..., Any], flag: str, value: Any) -> None:
    if flag not in inspect.signature(fn).parameters:
        pytest.skip(f"{fn.__name__} has no {flag}")
    x = _ok()
    if fn is kda_ops.recurrent_kda_update_:
        x.update(state_pool=make_state(2, 4, 4, 4), state_indices=torch.tensor([1]))
    with pytest.raises(TypeError, match=rf"^{flag}: expected a bool"):
        fn(**x, **{flag: value})


def test_the_layer_names_a_flag_that_is_not_a_bool() -> None:
    with pytest.raises(TypeError, match=r"^recompute_in_backward: expected a bool"):
        KDALayer(8, 1, 4, recompute_in_backward="no")
    layer = KDALayer(8, 1, 4)
    for flag in ("output_final_state", "recurrent"):
        with pytest.raises(TypeError, match=rf"^{flag}: expected a bool"):
            layer(torch.randn(1, 3, 8), **{flag: "yes"})


@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
def test_lower_bound_takes_a_python_number_or_a_cpu_scalar_tensor(fn: Callable[..., Any]) -> None:
    x = make_inputs(1, 8, 2, 4, 4, HV=4, gate_in_kernel=True)
    o, _ = fn(**x, use_gate_in_kernel=True, lower_bound=-5.0)
    for same in (-5, torch.tensor(-5.0), torch.tensor(-5.0, dtype=torch.float64), torch.tensor(-5)):
        torch.testing.assert_close(fn(**x, use_gate_in_kernel=True, lower_bound=same)[0], o, rtol=0, atol=0)
    # zero: no decay at all (g = 0), a bound still
    o0, _ = fn(**x, use_gate_in_kernel=True, lower_bound=0.0)
    plain = {n: t for n, t in x.items() if n not in ("A_log", "dt_bias")}
    torch.testing.assert_close(o0, fn(**{**plain, "g": torch.zeros_like(x["g"])})[0])
