"""``kda_ops.triton.launch``: the stage kernels' launch configuration, programmatic dependent launch, and the
cached launcher's key, a refinement of Triton's specialization key.

A launch key that merged two argument lists Triton specializes differently would launch a kernel compiled for the
other one (wrong alignment assumptions, a length specialized to 1). The GPU test
``tests/gpu/test_recurrent_gpu.py::test_cached_launch_equals_triton_launch`` runs the cached path itself.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

launch = pytest.importorskip("kda_ops.triton.launch")


def key(*args: Any) -> Any:
    return launch._arg_key(args)


def test_tensors_by_dtype_and_alignment() -> None:
    buf = torch.zeros(64, dtype=torch.float32)
    assert buf.data_ptr() % 16 == 0  # the allocator's alignment
    assert key(buf) == key(torch.zeros(8, dtype=torch.float32))
    assert key(buf) != key(buf.to(torch.bfloat16))
    assert key(buf) != key(buf[1:])  # 4 bytes off: another alignment class
    assert key(buf[4:]) == key(buf[8:])  # 16 and 32 bytes off: both aligned


def test_integers_by_residue_one_and_width() -> None:
    assert key(16) != key(17)
    assert key(1) != key(17)  # Triton makes an argument equal to 1 a constant
    assert key(2) == key(18)
    assert key(16) != key(2**32)  # needs 64 bits
    assert key(5) != key(5.0)


def test_none_and_floats() -> None:
    assert key(None) != key(0.5)
    assert key(0.5) == key(-3.0)  # floats are not specialized


def test_unclassified_arguments_take_tritons_path() -> None:
    assert key(True) is None
    assert key("x") is None
    assert key(2**70) is None


def test_constexpr_tail() -> None:
    def param(name: str, const: bool) -> Any:
        return SimpleNamespace(name=name, is_constexpr=const)

    ok = launch.Launcher(SimpleNamespace(params=[param("x", False), param("n", False), param("B", True)]))
    assert ok._constexpr_tail({"B": 4, "num_warps": 2}) == (4,)
    assert ok._constexpr_tail({"num_warps": 2}) is None  # a constexpr left to its default
    mixed = launch.Launcher(SimpleNamespace(params=[param("x", False), param("B", True), param("n", False)]))
    assert mixed._constexpr_tail({"B": 4}) is None


def test_two_entries_per_argument() -> None:
    """Fixed width: an optional tensor given or left None never shifts the entries of the arguments after it."""
    t = torch.zeros(4)
    assert len(key(None, 0.5, 7, t)) == 8
    assert key(None, 3) != key(t, 3)
    assert key(0.5, 0) != key(0, 0.5)


def test_launch_configuration_caps_tiles_at_the_head_dimension() -> None:
    """A stage's configured tiles, each capped at the power of two above its head dimension (the fused prepare
    stage: the solve stage's entry moved with its standalone kernel to the tests' ``stage_kernels``)."""
    cfg = launch.launch("prepare", BK=100, BV=16)
    stage = launch.LAUNCH["prepare"]
    assert cfg == {"num_warps": stage["num_warps"], "num_stages": stage["num_stages"], "BK": min(128, stage["BK"]),
                   "BV": 16}  # fmt: skip


def test_launch_configuration_caps_warps_at_narrow_tiles() -> None:
    """At K = V = 16 the backward's dq/dk stage runs 4 warps, one per 16 x 16 block of its [64, 16] tiles (8 read
    out of bounds on the GPU); at K = V = 128 it keeps its configured 8."""
    assert launch.launch("dqk", BK=16, BV=16)["num_warps"] == 4
    assert launch.launch("dqk", BK=128, BV=128)["num_warps"] == launch.LAUNCH["dqk"]["num_warps"] == 8


def test_launch_configuration_passes_a_register_cap_only_where_configured() -> None:
    """A stage's ``maxnreg`` reaches its launch options when its entry sets one, and no launch gets one otherwise."""
    table = {"a": {"num_warps": 4, "num_stages": 1, "BK": 32}, "b": {"num_warps": 4, "num_stages": 1, "maxnreg": 168}}
    assert "maxnreg" not in launch.launch("a", table, BK=128)
    assert launch.launch("b", table)["maxnreg"] == 168
    assert not any("maxnreg" in cfg for cfg in launch.LAUNCH.values())


def test_programmatic_dependent_launch_only_where_supported() -> None:
    """Off CUDA (and under the interpreter) the forward's kernels launch plainly; the toolkit gate reads versions."""
    assert dict(launch.pdl(torch.device("cpu"))) == {"PDL": False}
    assert launch.cuda_version("13.0") >= (12, 4) and launch.cuda_version("12.4") >= (12, 4)
    assert launch.cuda_version("12.1") < (12, 4) and launch.cuda_version(None) < (12, 4)
    assert launch.cuda_version("abc") == ()
