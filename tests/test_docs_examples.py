"""The code blocks of docs/compile.md and docs/serving.md run as written (on the CPU here)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
# the compiled training step of a KDALayer: about a minute under the interpreter
SLOW = {"compile.md-0"}
BLOCKS = [
    pytest.param(code, id=f"{page}-{i}", marks=[pytest.mark.slow] if f"{page}-{i}" in SLOW else [])
    for page in ("compile.md", "serving.md")
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S))
]


@pytest.mark.parametrize("code", BLOCKS)
def test_docs_example_runs(code: str) -> None:
    import torch

    torch._dynamo.reset()
    # a real, importable module of its own: torch.compile imports the module of the functions it compiles by name,
    # and its guards look the globals up there
    module = types.ModuleType(f"kda_docs_example_{abs(hash(code))}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, "<docs>", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
