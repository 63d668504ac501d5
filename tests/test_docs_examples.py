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


ROOT = DOCS.parent
# the project's own text: no issue numbers (what a reader needs is in the text itself)
TEXT = [*ROOT.glob("*.md"), *DOCS.glob("*.md"), *(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "tests").rglob("*.py"), ROOT / "noxfile.py"]  # fmt: skip


def test_no_text_cites_an_issue_number() -> None:
    pattern = re.compile(r"\bissues? #?\d", re.I)
    found = [f"{p.relative_to(ROOT)}:{i}" for p in TEXT for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line)]  # fmt: skip
    assert not found, found


def test_the_pages_install_nox_alike() -> None:
    for page in (ROOT / "README.md", DOCS / "index.md"):
        installs = re.findall(r"pip install (\S+) && nox", page.read_text())
        assert installs == ['"nox[uv]"'], (page.name, installs)


def test_the_api_page_lists_every_keyword_of_the_layer() -> None:
    import ast
    import inspect

    from kda_ops.nn import KDALayer

    text = " ".join((DOCS / "api.md").read_text().split())
    entry = text[text.index("`kda_ops.nn.KDALayer(") :].split("`", 2)[1]
    for name, param in inspect.signature(KDALayer.__init__).parameters.items():
        if param.kind is param.KEYWORD_ONLY:
            documented = re.search(rf"\b{name}=([^,)]+)", entry)
            assert documented and ast.literal_eval(documented.group(1)) == param.default, (name, entry)
