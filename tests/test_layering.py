"""The package's layers, read from the source (``ast``, nothing imported): every import of every module under
``src/kda_ops``, at module level or inside a function, follows these rules:

- ``kda_ops.reference`` (the oracle) and ``kda_ops.triton`` (the kernels) never import each other: the tests compare
  the two, and a kernel that borrowed the oracle's code would be checked against itself;
- only ``kda_ops/__init__.py``, ``kda_ops/_warmup.py``, ``kda_ops/nn.py``, ``kda_ops/__main__.py``,
  ``kda_ops/compat/fla.py`` and ``kda_ops/integrations/transformers.py`` import ``kda_ops.api`` (the public
  functions sit on top of everything else; the compat module renames them, the integration plugs them in);
- nothing under ``kda_ops.triton`` or ``kda_ops.reference`` imports ``kda_ops.ops`` (the ops pick the kernels; the
  kernels do not know the ops);
- nothing outside ``kda_ops.compat`` imports it but ``kda_ops/integrations/fla.py`` (which plugs the drop-in
  functions into fla's layer), and it imports nothing of the package but ``kda_ops.api`` (the drop-in names map onto
  the public functions, on top of everything).

The checker is tested on itself: a synthetic module for each rule, and a copy of the package with a violating
import planted, must be reported.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "kda_ops"
API_IMPORTERS = frozenset({"kda_ops", "kda_ops._warmup", "kda_ops.nn", "kda_ops.__main__", "kda_ops.compat.fla",
                           "kda_ops.integrations.transformers", "kda_ops.distributed"})
COMPAT_IMPORTERS = frozenset({"kda_ops.integrations.fla"})


@dataclass(frozen=True)
class Violation:
    module: str
    imported: str
    line: int
    rule: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported}: {self.rule}"


def module_name(path: Path, root: Path) -> str:
    """``kda_ops.triton.chunk.scan`` for ``<root>/kda_ops/triton/chunk/scan.py``; a package is its ``__init__``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """The modules that ``source`` (the code of ``module``) imports, with their lines: ``import a.b`` gives ``a.b``;
    ``from a import b`` gives ``a.b`` when that is a module of ``known``, else ``a``; relative imports resolved."""
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub if sub in known else target, node.lineno))
    return out


def violations(module: str, imported: str, line: int) -> list[Violation]:
    """The rules ``module`` breaks by importing ``imported``."""
    found = []
    if _within(module, "kda_ops.reference") and _within(imported, "kda_ops.triton"):
        found.append(Violation(module, imported, line, "the reference must not import the Triton kernels"))
    if _within(module, "kda_ops.triton") and _within(imported, "kda_ops.reference"):
        found.append(Violation(module, imported, line, "the Triton kernels must not import the reference"))
    if _within(imported, "kda_ops.api") and module not in API_IMPORTERS and not _within(module, "kda_ops.api"):
        found.append(Violation(module, imported, line, f"only {sorted(API_IMPORTERS)} may import kda_ops.api"))
    if (_within(module, "kda_ops.triton") or _within(module, "kda_ops.reference")) and _within(imported, "kda_ops.ops"):
        found.append(Violation(module, imported, line, "the kernels must not import kda_ops.ops"))
    if _within(imported, "kda_ops.compat") and not _within(module, "kda_ops.compat") and module not in COMPAT_IMPORTERS:
        found.append(Violation(module, imported, line, f"only {sorted(COMPAT_IMPORTERS)} may import kda_ops.compat"))
    if (
        _within(module, "kda_ops.compat")
        and _within(imported, PACKAGE)
        and not (_within(imported, "kda_ops.api") or _within(imported, "kda_ops.compat"))
    ):
        found.append(Violation(module, imported, line, "kda_ops.compat maps onto kda_ops.api alone"))
    return found


def check_tree(root: Path) -> list[Violation]:
    """Every violation of the rules in the package ``<root>/kda_ops``."""
    paths = sorted((root / PACKAGE).rglob("*.py"))
    known = {module_name(p, root) for p in paths}
    found: list[Violation] = []
    for path in paths:
        module = module_name(path, root)
        for imported, line in imported_modules(path.read_text(), module, path.name == "__init__.py", known):
            found.extend(violations(module, imported, line))
    return found


def check_source(source: str, module: str, is_package: bool = False, known: set[str] | None = None) -> list[Violation]:
    """The violations of one module's source (``known``: the package's modules, default those under ``src``)."""
    if known is None:
        known = {module_name(p, SRC) for p in (SRC / PACKAGE).rglob("*.py")}
    found: list[Violation] = []
    for imported, line in imported_modules(source, module, is_package, known):
        found.extend(violations(module, imported, line))
    return found


# --------------------------------------------------------------------------------------------------- tests


def test_the_package_keeps_its_layers() -> None:
    assert (SRC / PACKAGE / "__init__.py").exists()
    found = check_tree(SRC)
    assert not found, "layering violations:\n" + "\n".join(map(str, found))


def test_the_checker_reads_every_module() -> None:
    """The walk sees the package's layers (a checker that read nothing would pass everything)."""
    modules = {module_name(p, SRC) for p in (SRC / PACKAGE).rglob("*.py")}
    assert {"kda_ops", "kda_ops.api", "kda_ops.ops", "kda_ops._warmup"} <= modules
    assert any(m.startswith("kda_ops.triton.") for m in modules)
    assert any(m.startswith("kda_ops.reference.") for m in modules)
    # ops imports the reference (allowed), and the checker sees that import
    ops = (SRC / PACKAGE / "ops.py").read_text()
    known = modules
    assert any(_within(name, "kda_ops.reference") for name, _ in imported_modules(ops, "kda_ops.ops", False, known))


BAD = {
    "reference imports triton": ("kda_ops.reference.chunk.scan", "from kda_ops.triton.chunk import scan\n"),
    "reference imports triton (relative)": ("kda_ops.reference.chunk.scan", "from ...triton.launch import pow2\n"),
    "triton imports reference": ("kda_ops.triton.chunk.dv", "import kda_ops.reference.chunk.dv as oracle\n"),
    "triton imports reference (in a function)": (
        "kda_ops.triton.chunk.forward",
        "def f():\n    from kda_ops import reference\n    return reference\n",
    ),
    "triton imports api": ("kda_ops.triton.recurrent.forward", "from kda_ops.api import recurrent_kda\n"),
    "common imports api": ("kda_ops.common", "from kda_ops import api\n"),
    "triton imports ops": ("kda_ops.triton.launch", "from kda_ops import ops\n"),
    "reference imports ops (relative)": ("kda_ops.reference.naive", "from ..ops import TRITON_KERNELS\n"),
    "api imports compat": ("kda_ops.api", "from kda_ops.compat import fla\n"),
    "compat imports triton": ("kda_ops.compat.fla", "from kda_ops import triton\nfrom kda_ops import api\n"),
}


@pytest.mark.parametrize("case", BAD)
def test_the_checker_reports_a_synthetic_violation(case: str) -> None:
    module, source = BAD[case]
    found = check_source(source, module)
    assert len(found) == 1 and found[0].module == module and found[0].line >= 1, found


GOOD = {
    "ops imports the reference and triton": ("kda_ops.ops", "from kda_ops import reference\nimport kda_ops.triton\n"),
    "warmup imports api": ("kda_ops._warmup", "from kda_ops.api import chunk_kda\n"),
    "the package imports api": ("kda_ops", "from kda_ops.api import chunk_kda\n"),
    "nn imports api": ("kda_ops.nn", "from kda_ops import api\n"),
    "main imports api": ("kda_ops.__main__", "import kda_ops.api\n"),
    "compat imports api": ("kda_ops.compat.fla", "from kda_ops import api\n"),
    "triton imports common": ("kda_ops.triton.chunk.scan", "from kda_ops.common import Options\nfrom .. import lang\n"),
    "reference imports transforms": ("kda_ops.reference.inputs", "from kda_ops.transforms import gate\n"),
}


@pytest.mark.parametrize("case", GOOD)
def test_the_checker_passes_allowed_imports(case: str) -> None:
    module, source = GOOD[case]
    assert check_source(source, module, is_package=module == "kda_ops") == []


def test_the_checker_reports_a_violation_planted_in_a_copy(tmp_path: Path) -> None:
    """A copy of the package passes; the same copy with one violating import added to a kernel module is
    reported, at that module and line."""
    shutil.copytree(SRC / PACKAGE, tmp_path / PACKAGE)
    assert check_tree(tmp_path) == check_tree(SRC)
    target = tmp_path / PACKAGE / "triton" / "launch.py"
    lines = target.read_text().splitlines()
    line = len(lines) + 1
    target.write_text("\n".join([*lines, "from kda_ops.reference import naive_recurrent_kda  # planted", ""]))
    planted = [v for v in check_tree(tmp_path) if v not in check_tree(SRC)]
    assert [(v.module, v.line) for v in planted] == [("kda_ops.triton.launch", line)], planted


# ----------------------------------------------------------------------------------------------- dependencies

ROOT = SRC.parent


def test_the_triton_extra_brings_numpy() -> None:
    """Triton's interpreter imports numpy, which a CPU build of torch does not install."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower() for req in extras["triton"]}
    assert {"triton", "numpy"} <= names, extras["triton"]


def test_the_base_install_runs_without_numpy() -> None:
    """Without triton's interpreter nothing needs numpy: both functions run on the CPU with numpy unimportable."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import warnings; warnings.simplefilter('ignore')\n"  # torch's own 'Failed to initialize NumPy' warning
        "import kda_ops\n"
        "from kda_ops.testing import make_inputs\n"
        "x = make_inputs(1, 5, 1, 4, 4)\n"
        "kda_ops.chunk_kda(**x)[0].sum().item(); kda_ops.recurrent_kda(**x)[0].sum().item()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "KDA_OPS_CPU_BACKEND": "reference"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
