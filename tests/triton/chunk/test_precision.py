"""``kda_ops.triton.chunk.precision``: the per-product precisions of the chunk kernels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.6")

from kda_ops.triton.chunk.precision import exact_bf16  # noqa: E402


def test_exact_bf16_only_for_bf16_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Products whose operands are all stored in bf16 run in bf16 on the GPU (exact operands: the same products);
    any other operand dtype keeps the given precision, and so does the interpreter."""
    b, h, f = (torch.zeros(2, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.float32))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert exact_bf16("tf32", b, b) == "bf16"
    assert exact_bf16("tf32", b, f) == exact_bf16("tf32", h, b) == "tf32"
    assert exact_bf16("ieee", f, f) == "ieee"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert exact_bf16("tf32", b, b) == "tf32"
