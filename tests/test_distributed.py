"""kda_ops.distributed.chunk_kda over gloo, 2 and 4 CPU processes: each rank's slice of the outputs, the final
states and every gradient equal ``chunk_kda`` on the whole sequence (float64 and float32), with sequences that cross
rank boundaries, an empty slice, grouped value heads and every option; and the call compiled with fullgraph.

Each spawn runs all of its cases in one process group (a process start costs seconds on two cores); every rank
writes its worst relative error per tensor, which the test prints (``pytest -s``) and bounds.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kda_ops
from kda_ops import distributed
from kda_ops.testing import make_inputs, make_state, rel_err

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

# (name, dtype, B, H, HV, K, V, per-rank slice lengths by world size, cu_seqlens or None, options, initial state)
CASES: list[dict[str, Any]] = [
    dict(name="dense-gva-gate", dtype=torch.float64, B=2, H=1, HV=2, K=8, V=6,
         slices={2: [70, 30], 4: [20, 0, 50, 30]},
         cu=None, h0=True, opts=dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True)),
    dict(name="packed-crossing", dtype=torch.float64, B=1, H=2, HV=2, K=8, V=8,
         slices={2: [75, 85], 4: [40, 45, 0, 75]},
         cu=[0, 5, 40, 40, 130, 160], h0=True, opts=dict(allow_neg_eigval=True, state_v_first=True)),
    dict(name="packed-bound-f32", dtype=torch.float32, B=1, H=1, HV=2, K=16, V=8,
         slices={2: [64, 36], 4: [30, 30, 30, 10]},
         cu=[0, 64, 65, 100], h0=False, opts=dict(use_gate_in_kernel=True, lower_bound=-5.0,
                                                  use_qk_l2norm_in_kernel=True)),
    dict(name="dense-f32", dtype=torch.float32, B=1, H=2, HV=2, K=8, V=8, slices={2: [50, 50], 4: [25, 25, 25, 25]},
         cu=None, h0=True, opts=dict(use_qk_l2norm_in_kernel=True)),
    dict(name="packed-no-h0-gate", dtype=torch.float64, B=1, H=2, HV=2, K=32, V=32,
         slices={2: [256, 256], 4: [128, 128, 128, 128]}, cu=[0, 64, 448, 512], h0=False,
         opts=dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)),
    # K + V over one head's 256 columns: the slice runs as two calls (the values, then the map)
    dict(name="wide-two-calls", dtype=torch.float64, B=1, H=1, HV=1, K=136, V=128,
         slices={2: [40, 30], 4: [10, 20, 20, 20]},
         cu=None, h0=True, opts=dict(scale=0.3, recompute_in_backward=True)),
]  # fmt: skip


def _inputs(case: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]:
    T = sum(case["slices"][2])
    gate = bool(case["opts"].get("use_gate_in_kernel"))
    x = make_inputs(case["B"], T, case["H"], case["K"], case["V"], HV=case["HV"], dtype=case["dtype"],
                    gate_in_kernel=gate, beta_logits=bool(case["opts"].get("use_beta_sigmoid_in_kernel")))  # fmt: skip
    if case["opts"].get("lower_bound") is not None:
        x.pop("A_log")
    cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int32)
    N = case["B"] if cu is None else len(case["cu"]) - 1
    h0 = None
    if case["h0"]:
        h0 = make_state(N, case["HV"], case["K"], case["V"], dtype=torch.float64 if case["dtype"] == torch.float64
                        else torch.float32)  # fmt: skip
        if case["opts"].get("state_v_first"):
            h0 = h0.transpose(-1, -2).contiguous()
    return x, cu, h0


def _run_case(case: dict[str, Any], rank: int, world: int, compiled: bool) -> dict[str, float]:
    x, cu, h0 = _inputs(case)
    opts = case["opts"]
    leaves = {n: t.requires_grad_() for n, t in x.items()}
    if h0 is not None:
        leaves["initial_state"] = h0.requires_grad_()
    o, final = kda_ops.chunk_kda(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu, **opts)
    assert final is not None
    gen = torch.Generator().manual_seed(7)
    do, dfinal = torch.randn(o.shape, generator=gen).to(o.dtype), torch.randn(final.shape, generator=gen)
    grads = torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), list(leaves.values()))
    want = dict(zip(leaves, grads))

    bounds = [0, *torch.tensor(case["slices"][world]).cumsum(0).tolist()]
    lo, hi = bounds[rank], bounds[rank + 1]
    tokenwise = {"q", "k", "v", "g", "beta"}
    mine = {n: (t.detach()[:, lo:hi] if n in tokenwise else t.detach()).clone().requires_grad_()
            for n, t in leaves.items()}  # fmt: skip
    fn = distributed.chunk_kda
    if compiled:  # aot_eager: the whole call, backward included, traced as one graph without inductor's codegen
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = {n: t for n, t in mine.items() if n != "initial_state"}
    h0_r = mine.get("initial_state")
    o_r, final_r = fn(**args, initial_state=h0_r, output_final_state=True, cu_seqlens=cu, **opts)
    assert final_r is not None
    loss = (o_r * do[:, lo:hi]).sum() + ((final_r * dfinal).sum() if rank == world - 1 else 0)
    got = dict(zip(mine, torch.autograd.grad(loss, list(mine.values()), allow_unused=True)))

    errs = {"o": rel_err(o_r, o[:, lo:hi]), "final_state": rel_err(final_r, final)}
    for n, gr in got.items():
        if n in tokenwise:
            errs[f"d{n}"] = rel_err(gr, want[n][:, lo:hi]) if hi > lo else 0.0
        elif n == "initial_state":  # used on the first rank only: its gradient comes back there
            errs["dinitial_state"] = rel_err(gr, want[n]) if rank == 0 else float(gr is not None and gr.abs().max())
        else:  # a parameter shared by the ranks: the sum of their gradients, as data parallelism all-reduces it
            total = gr.clone()
            dist.all_reduce(total)
            errs[f"d{n}"] = rel_err(total, want[n])
    return errs


def _worker(rank: int, world: int, store: str, out: str, names: list[str], compiled: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = {c["name"]: _run_case(c, rank, world, compiled) for c in CASES if c["name"] in names}
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _spawn(world: int, names: list[str], compiled: bool = False) -> dict[str, dict[str, float]]:
    """Run the named cases on ``world`` ranks; the worst error per case and tensor over the ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_worker, args=(world, store, tmp, names, compiled), nprocs=world, join=True)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    worst: dict[str, dict[str, float]] = {}
    for result in per_rank:
        for name, errs in result.items():
            for tensor, err in errs.items():
                worst.setdefault(name, {})[tensor] = max(err, worst.get(name, {}).get(tensor, 0.0))
    return worst


def _check(worst: dict[str, dict[str, float]], world: int) -> None:
    dtypes = {c["name"]: c["dtype"] for c in CASES}
    for name, errs in worst.items():
        print(f"\n{world} ranks, {name}: " + ", ".join(f"{t} {e:.1e}" for t, e in errs.items()))
        bad = {t: e for t, e in errs.items() if not e <= TOL[dtypes[name]]}
        assert not bad, f"{world} ranks, {name}: errors over {TOL[dtypes[name]]:.0e}: {bad}"


# the spawns take ~60 s on two cores and no Triton: they run in the rows of the whole suite only
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_distributed_equals_one_process(world: int) -> None:
    _check(_spawn(world, [c["name"] for c in CASES]), world)


@pytest.mark.slow
def test_distributed_compiles_fullgraph() -> None:
    _check(_spawn(2, ["packed-crossing", "dense-f32"], compiled=True), 2)


def test_distributed_needs_a_process_group() -> None:
    x = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(ValueError, match="group"):
        distributed.chunk_kda(**x)


def test_distributed_names_the_bad_argument(tmp_path: Path) -> None:
    """One rank: the checks that come before any collective, and the global ``cu_seqlens`` against the row."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = make_inputs(1, 8, 1, 4, 4)
        with pytest.raises(ValueError, match="initial_state"):
            distributed.chunk_kda(**x, initial_state=torch.zeros(1, 1, 4, 5))
        with pytest.raises(ValueError, match="cu_seqlens"):
            distributed.chunk_kda(**x, cu_seqlens=torch.tensor([0, 3, 9]))
        with pytest.raises(ValueError, match="^cu_seqlens: expected a 1-D tensor"):
            distributed.chunk_kda(**x, cu_seqlens=torch.tensor([[0, 3, 8]]))
        for bad, name in (({"cu_seqlens": [0, 3, 8]}, "cu_seqlens"), ({"q": x["q"].tolist()}, "q"),
                          ({"initial_state": torch.zeros(1, 1, 4, 4, dtype=torch.int32)}, "initial_state")):
            with pytest.raises(TypeError, match=f"^{name}: expected"):
                distributed.chunk_kda(**{**x, **bad})
        # named before the slice is widened by the identity's columns (the meta device stands in for another)
        for bad, name in (({"v": torch.cat([x["v"], x["v"]])}, "v"), ({"v": x["v"][:, :4]}, "v"),
                          ({"g": x["g"][..., :2]}, "g"), ({"beta": x["beta"][..., None]}, "beta"),
                          ({"initial_state": torch.zeros(1, 1, 4, 4, device="meta")}, "initial_state"),
                          ({"cu_seqlens": torch.tensor([0, 3, 8], device="meta")}, "cu_seqlens"),
                          ({**make_inputs(2, 8, 1, 4, 4), "cu_seqlens": torch.tensor([0, 3, 8])}, "cu_seqlens")):
            with pytest.raises(ValueError, match=f"^{name}: expected"):
                distributed.chunk_kda(**{**x, **bad})
        with pytest.raises(TypeError, match="^use_gate_in_kernel: expected"):
            distributed.chunk_kda(**x, use_gate_in_kernel=1)
        o, _ = distributed.chunk_kda(**x, cu_seqlens=torch.tensor([0, 3, 8]))
        assert torch.allclose(o, kda_ops.chunk_kda(**x, cu_seqlens=torch.tensor([0, 3, 8]))[0])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_torchrun_example_runs() -> None:
    """examples/context_parallel.py under torchrun, 2 CPU ranks, as docs/distributed.md shows it."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "examples" / "context_parallel.py"), "--tokens", "256"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    print("\n" + line)
    assert float(line.rsplit(" ", 1)[-1]) < 1e-5, line


@pytest.mark.slow
def test_bench_distributed_runs_on_cpu(tmp_path: Path) -> None:
    """benchmarks/bench_distributed.py's torchrun mode on 2 CPU ranks (gloo) writes its row, whose check matches one
    process, and its table mode reads the row back."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH")]))}
    script = str(root / "benchmarks" / "bench_distributed.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
           "--scaling", "strong", "--device", "cpu", "--T", "128", "--H", "2", "--D", "16", "--reps", "1", "--check",
           "--rows", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads((tmp_path / "strong-2.json").read_text())
    assert row["ranks"] == 2 and row["T_rank"] == 64 and row["forward_ms"] > 0
    assert row["check"]["float64 vs one process"] < 1e-12, row["check"]
    assert row["check"]["float32 vs one process"] < 1e-5, row["check"]
    table = subprocess.run([sys.executable, script, "--tables", str(tmp_path)], capture_output=True, text=True,
                           timeout=300, env=env)  # fmt: skip
    assert table.returncode == 0, table.stderr[-3000:]
    assert "| 2 | 128 | 64 |" in table.stdout, table.stdout
