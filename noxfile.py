"""Sessions: ``nox -s tests`` (the CPU matrix), ``lint``, ``typecheck``, ``build``, ``docs``, and three that run in
the machine's own Python without installing anything: ``gpu`` (the ``gpu``-marked tests), ``sanitize`` and
``bench``.

CPU torch: a plain ``pip install torch`` on Linux fetches the CUDA build (gigabytes). The sessions take a CPU build
from a local wheel folder when pip is configured with one (``PIP_FIND_LINKS`` or pip's ``find-links`` setting; uv
does not read pip's configuration, so it is handed over as ``UV_FIND_LINKS``), else from PyTorch's CPU index.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "typecheck", "tests"]

ROOT = Path(__file__).parent
TORCH = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# the release whose KimiLinearDeltaAttention kda_ops.nn.KimiDeltaAttention is tested against
TRANSFORMERS = "5.17.0"

# (torch, triton, numpy pin, selection). Every torch with the triton it pins, and the other triton releases on one
# torch: triton <= 3.6's interpreter breaks with numpy >= 2.4. Between them the first and the fourth row run every
# test once: "triton", each test that needs triton (the Triton kernels under the interpreter, every sm_90 compile
# check, the benchmark scripts) on triton 3.6, the GPU's; "layers", the layers above the kernels (reference, ops,
# public functions, compile/export, nn, integrations, with transformers) without triton at all. "kernels": the
# kernel families (tests/triton) and the serving kernels without the ``slow`` tests (the sweeps over options and
# gates of one stage, gradcheck, compiled training steps) on the other triton releases. "layers-quick": the layers
# without the slow tests, on the oldest claimed torch (2.6: the triton 3.2 it pins is below the kernels' minimum,
# which they refuse) and the newest (2.14.1, with its triton 3.8). A triton of None is the one torch pins (a CUDA
# build from the configured index), "none" none at all.
MATRIX = [
    nox.param(TORCH, "3.6.0", "numpy<2.4", "triton", id="torch2.13-triton3.6"),
    nox.param(TORCH, "3.7.1", "numpy", "kernels", id="torch2.13-triton3.7"),
    nox.param(TORCH, "3.9.0", "numpy", "kernels", id="torch2.13-triton3.9"),
    nox.param(TORCH, "none", None, "layers", id="torch2.13-no-triton"),
    nox.param("2.6.0", None, "numpy<2.4", "layers-quick", id="torch2.6-triton3.2"),
    nox.param("2.14.1", None, "numpy", "layers-quick", id="torch2.14.1-triton3.8"),
]
SELECT = {
    "triton": ["-m", "interpret or triton", "tests"],
    "layers": ["-m", "not interpret and not triton", "tests"],
    "kernels": ["-m", "not slow", "tests/triton", "tests/test_serving.py"],
    "layers-quick": ["-m", "not slow and not interpret and not triton", "tests"],
}


def _pip_setting(name: str, env: str) -> list[str]:
    """A space-separated pip setting (environment first, then pip's config files)."""
    values = os.environ.get(env, "").split()
    if not values:
        try:
            out = subprocess.run(
                [sys.executable, "-m", "pip", "config", "get", f"global.{name}"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        values = out.split()
    return values


FIND_LINKS = [link for link in _pip_setting("find-links", "PIP_FIND_LINKS") if os.path.isdir(link)]
EXTRA_INDEX = _pip_setting("extra-index-url", "PIP_EXTRA_INDEX_URL")
if FIND_LINKS and "UV_FIND_LINKS" not in os.environ:
    os.environ["UV_FIND_LINKS"] = " ".join(FIND_LINKS)
if EXTRA_INDEX and "UV_EXTRA_INDEX_URL" not in os.environ:
    os.environ["UV_EXTRA_INDEX_URL"] = " ".join(EXTRA_INDEX)
    # every index at once, as pip reads them (uv's default takes a package from the first index that has it)
    os.environ.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")


def _torch(version: str) -> list[str]:
    """Install arguments for torch ``version``: a local CPU build, else the build of the index pip is configured
    with (a CUDA build there, with the triton it pins; it runs on the CPU), else PyTorch's CPU index."""
    if any(glob.glob(os.path.join(d, f"torch-{version}+cpu-*.whl")) for d in FIND_LINKS):
        return [f"torch=={version}+cpu"]
    if EXTRA_INDEX:
        return [f"torch=={version}"]
    return [f"torch=={version}", "--index-url", TORCH_CPU_INDEX]


def _install_package(session: nox.Session, target: str = ".") -> None:
    """Install kda-ops itself without touching its dependencies, rebuilt every time (venvs are reused)."""
    if session.venv_backend == "uv":
        session.install("--no-deps", "--reinstall-package", "kda-ops", target)
    else:
        session.install("--no-deps", "--force-reinstall", target)


@nox.session
@nox.parametrize(("torch", "triton", "numpy", "select"), MATRIX)
def tests(session: nox.Session, torch: str, triton: str | None, numpy: str | None, select: str) -> None:
    """The test suite on the CPU: reference kernels, ops, compile/export, and Triton kernels under the interpreter
    (the row's selection of it: ``SELECT``)."""
    session.install(*_torch(torch))
    # setuptools: torch 2.6's inductor imports it, and a uv venv has none
    session.install("pytest", "pytest-xdist", "setuptools", *([f"triton=={triton}"] if triton not in (None, "none")
                    else []), *([numpy] if numpy else []))  # fmt: skip
    if select == "layers":  # the Kimi Linear layer's tests against transformers' own layer (skipped where it is absent)
        session.install(f"transformers=={TRANSFORMERS}")
    _install_package(session)
    # the versions the row runs; the no-triton row makes sure nothing brought triton in
    check = "sys.exit('triton is installed') if c.triton_version() else None" if triton == "none" else "None"
    session.run("python", "-c", "import sys, torch, kda_ops.common as c; print('torch', torch.__version__, 'triton', "
                f"c.triton_version()); {check}")  # fmt: skip
    # one worker per core (at most 4): the interpreter runs each test on one core, and CI has two
    workers = ["-n", str(min(4, os.cpu_count() or 1))]
    session.run("python", "-m", "pytest", "-q", *workers, *SELECT[select], *session.posargs,
                env={"TRITON_INTERPRET": "1"})  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    paths = [p for p in ("src", "tests", "noxfile.py", "benchmarks") if (ROOT / p).exists()]
    session.run("ruff", "check", *paths, *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    """``mypy --strict`` over src/ (settings in pyproject.toml; triton through stubs/)."""
    session.install(*_torch(TORCH))
    session.install("mypy")
    session.run("mypy", "--strict", *session.posargs)


@nox.session(reuse_venv=False)
def build(session: nox.Session) -> None:
    """Build the wheel, install it into this fresh venv (no source tree on the path), import it, call it once."""
    uv = session.venv_backend == "uv"
    session.install("build[uv]" if uv else "build")
    out = Path(tempfile.mkdtemp(prefix="kda-ops-wheel-"))
    installer = ["--installer", "uv"] if uv else []
    session.run("python", "-m", "build", "--wheel", "--outdir", str(out), *installer)
    wheels = sorted(out.glob("kda_ops-*-py3-none-any.whl"))
    if len(wheels) != 1:
        session.error(f"expected one pure wheel kda_ops-*-py3-none-any.whl in {out}, found {os.listdir(out)}")
    session.log(f"wheel: {wheels[0].name}")
    session.install(*_torch(TORCH))
    _install_package(session, str(wheels[0]))
    session.chdir(out)
    session.run("python", "-c", SMOKE)
    shutil.rmtree(out, ignore_errors=True)


SMOKE = """
import pathlib, torch, kda_ops
from kda_ops.testing import make_inputs
assert "site-packages" in kda_ops.__file__, kda_ops.__file__
assert (pathlib.Path(kda_ops.__file__).parent / "py.typed").exists()
o, s = kda_ops.chunk_kda(**make_inputs(1, 8, 1, 4, 4), output_final_state=True)
assert o.shape == (1, 8, 1, 4) and s.shape == (1, 1, 4, 4) and torch.isfinite(o).all()
print("kda_ops", kda_ops.__version__, "from", kda_ops.__file__, ": chunk_kda OK")
"""


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation with warnings as errors."""
    session.install("mkdocs-material")
    site = tempfile.mkdtemp(prefix="kda-ops-site-")
    session.run("mkdocs", "build", "--strict", "--site-dir", site, *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


def worker_count(args: list[str]) -> int:
    """The pytest-xdist workers that ``args`` ask for (``-n N``, ``-nN``, ``--numprocesses N``); 1 when none or
    ``auto``."""
    for i, arg in enumerate(args):
        value = None
        if arg in ("-n", "--numprocesses") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("-n") and len(arg) > 2:
            value = arg[2:]
        elif arg.startswith("--numprocesses="):
            value = arg.partition("=")[2]
        if value is not None:
            return int(value) if value.isdigit() else 1
    return 1


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The ``gpu``-marked tests in the machine's own Python (the H200: torch 2.11, triton 3.6, no network).

    Nothing is installed: kda_ops is imported from src/. Without nox there, the same is
    ``PYTHONPATH=src python -m kda_ops && PYTHONPATH=src python -m pytest -m gpu tests``. Arguments after ``--``
    go to pytest: with pytest-xdist installed, ``nox -s gpu -- -n 8`` runs the GPU files in parallel processes
    (a few minutes on the H200, against ~15 in one process). With ``-n N`` each worker's torch gets the machine's
    cores over N threads unless ``OMP_NUM_THREADS`` is set: the float64 oracles of the every-kernel file run on the
    CPU, and sixteen threads per worker left that file unfinished after 520 s with 8 workers on a 16-core H100 host,
    where two per worker ran it with ``tests/triton`` in 95 s.
    """
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    workers = worker_count(session.posargs)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    # a GPU job on a machine without a GPU would skip every test and pass: refuse instead
    session.run("python", "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')")
    session.run("python", "-m", "kda_ops", env=env)
    session.run("python", "-m", "pytest", "-m", "gpu", "tests", *session.posargs, env=env)


@nox.session(venv_backend="none")
def sanitize(session: nox.Session) -> None:
    """Every Triton kernel and launch form once (``tests/gpu/test_every_kernel.py``) under compute-sanitizer, in the
    machine's own Python: memcheck, then racecheck; ``nox -s sanitize -- memcheck`` runs one tool. Each test runs in
    a process of its own under the tool, ``KDA_SANITIZE_JOBS`` (default 4) at a time, and its summary is logged as
    it ends (in order of completion): under racecheck a test takes from 7 s to over 500 s on an H200, and the file
    in one process took over 30 minutes. The session fails where a process exits non-zero (an error report, or a
    failed test) or a summary counts warnings. torch's caching allocator is off so that memcheck sees each tensor's
    own bounds.
    """
    if shutil.which("compute-sanitizer") is None:
        session.error("compute-sanitizer is not on PATH")
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    session.run("python", "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')")
    tests = "tests/gpu/test_every_kernel.py"
    listed = subprocess.run(["python", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", tests],
                            capture_output=True, text=True, env=env, cwd=ROOT)  # fmt: skip
    ids = [line for line in listed.stdout.splitlines() if line.startswith(tests + "::")]
    if listed.returncode != 0 or not ids:
        session.error(f"collecting {tests} failed:\n{listed.stdout}\n{listed.stderr}")
    jobs = max(1, int(os.environ.get("KDA_SANITIZE_JOBS", "4")))
    failed = []
    for tool in session.posargs or ["memcheck", "racecheck"]:
        for name, code, summary in _sanitized(tool, ids, env, jobs):
            session.log(f"{tool} {name}: exit {code}; {summary}")
            if code != 0 or re.search(r"\b[1-9]\d* warnings?\b", summary):
                failed.append(f"{tool} {name}")
    if failed:
        session.error(f"compute-sanitizer reported errors or warnings (or a test failed) in: {failed}")


def _sanitized(tool: str, ids: list[str], env: dict[str, str], jobs: int) -> list[tuple[str, int, str]]:
    """Each test id of ``ids`` under ``compute-sanitizer --tool tool`` in a process of its own (in the repository's
    root), ``jobs`` at a time: its name, exit status and the tool's summary line, in order of completion. The last
    lines of a process that exits non-zero are printed."""
    out: list[tuple[str, int, str]] = []
    running: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            pending = list(enumerate(ids))
            while pending or running:
                while pending and len(running) < jobs:
                    i, test = pending.pop(0)
                    log = Path(tmp) / f"{i}.txt"
                    cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "1", "--print-limit", "20",
                           "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", test]  # fmt: skip
                    with log.open("wb") as f:
                        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
                    running.append((test, proc, log))
                done = next((r for r in running if r[1].poll() is not None), None)
                if done is None:
                    time.sleep(1.0)
                    continue
                running.remove(done)
                test, proc, log = done
                code = proc.wait()
                lines = log.read_text(errors="replace").splitlines()
                summary = next((ln.strip("= ") for ln in reversed(lines) if "SUMMARY" in ln), "no summary printed")
                if code != 0:
                    print("\n".join(lines[-40:]))
                out.append((test.split("::", 1)[1], code, summary))
        finally:  # an interrupted session leaves no sanitizer running
            for _, proc, _ in running:
                proc.kill()
                proc.wait()
    return out


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks in the machine's own Python.

    ``nox -s bench`` runs benchmarks/bench_recurrent.py, bench_chunk.py, bench_chunk_bwd.py, bench_prefill.py,
    bench_serving.py, bench_distributed.py and bench_kimi.py; ``nox -s bench -- chunk`` only the second; arguments
    after a second ``--`` go to every script: ``nox -s bench -- chunk -- --quick``.
    """
    args = list(session.posargs)
    cut = args.index("--") if "--" in args else len(args)
    names, script_args = args[:cut], args[cut + 1 :]
    names = names or ["recurrent", "chunk", "chunk_bwd", "prefill", "serving", "distributed", "kimi"]
    scripts = [ROOT / "benchmarks" / (n if n.endswith(".py") else f"bench_{n}.py") for n in names]
    found = [s for s in scripts if s.exists()]
    if len(found) != len(scripts) and args[:cut]:
        session.error(f"no such benchmark: {[str(s) for s in scripts if not s.exists()]}")
    if not found:
        session.skip("no benchmark scripts in benchmarks/ yet")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for script in found:
        session.run("python", str(script), *script_args, env=env)
