"""``kda_ops.transforms``: the option transforms of the public contract (l2norm, gate), as their formulas."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_ops.transforms import gate, l2norm
from tests.cases import F64


def test_option_formulas() -> None:
    x = torch.randn(3, 5, dtype=F64)
    torch.testing.assert_close(l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    raw = torch.randn(4, 2, 3, dtype=F64)
    A, b = torch.randn(2, dtype=F64), torch.randn(6, dtype=F64)
    torch.testing.assert_close(gate(raw, A, b, None), -A.exp()[:, None] * F.softplus(raw + b.view(2, 3)))
    torch.testing.assert_close(gate(raw, A, b, -5.0), -5.0 * torch.sigmoid(A.exp()[:, None] * (raw + b.view(2, 3))))
    torch.testing.assert_close(gate(raw, None, None, -5.0), -5.0 * torch.sigmoid(raw))
