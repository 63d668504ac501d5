"""An engine-like serving loop over the pool ops, for the CPU and GPU tests: sequences arrive (a packed chunked
prefill into the pool), decode one token a step, verify speculative drafts with a random acceptance, and finish;
every sequence's kept outputs are then compared with ``recurrent_kda`` over its kept tokens alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import kda_ops
from kda_ops.testing import rel_err

OPTS: dict[str, Any] = {"use_qk_l2norm_in_kernel": True}
NAMES = ("q", "k", "v", "g", "beta")


@dataclass
class Seq:
    slot: int
    tokens: list[dict[str, Tensor]] = field(default_factory=list)  # kept tokens, each [1, n, ...]
    outputs: list[Tensor] = field(default_factory=list)  # kept outputs, each [n, HV, V]


def _tokens(n: int, T: int, H: int, D: int, gen: torch.Generator, device: str) -> dict[str, Tensor]:
    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    g = torch.nn.functional.logsigmoid(rnd(n, T, H, D))
    beta = torch.rand(n, T, H, generator=gen).to(device)
    return {"q": rnd(n, T, H, D), "k": rnd(n, T, H, D), "v": rnd(n, T, H, D), "g": g, "beta": beta}


class Steps:
    """The two fixed-shape steps (decode, verify), run eagerly or, with ``graphs``, each shape captured once in a
    CUDA graph over static buffers and replayed with the step's inputs copied in."""

    def __init__(self, pool: Tensor, graphs: bool) -> None:
        self.pool, self.graphs = pool, graphs
        self.cache: dict[str, tuple[Any, dict[str, Tensor], Tensor]] = {}

    def run(self, kind: str, x: dict[str, Tensor]) -> Tensor:
        def call(a: dict[str, Tensor]) -> Tensor:
            extra = {"num_accepted_tokens": a["acc"]} if kind == "verify" else {}
            return kda_ops.recurrent_kda_update_(*(a[n] for n in NAMES), self.pool, a["idx"], **extra, **OPTS)

        if not self.graphs:
            return call(x)
        if kind not in self.cache:
            static = {n: t.clone() for n, t in x.items()}
            scratch = self.pool.clone()
            saved, self.pool = self.pool, scratch
            call(static)  # compile before the capture, on a scratch pool
            torch.cuda.synchronize()
            self.pool = saved
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call(static)
            self.cache[kind] = (graph, static, out)
        graph, static, out = self.cache[kind]
        for n, t in x.items():
            static[n].copy_(t)
        graph.replay()
        return out.clone()


def run_engine(device: str, steps: int, batch: int, H: int, D: int, seed: int = 0, graphs: bool = False,
               T_spec: int = 3) -> list[Seq]:  # fmt: skip
    """Run the loop; return every sequence that lived (finished or not)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    S = batch * (T_spec + 1) + 4
    pool = torch.zeros(S, H, D, D, device=device)
    free = list(range(S))
    live: list[Seq] = []
    done: list[Seq] = []
    st = Steps(pool, graphs)
    for step in range(steps):
        # arrivals: a packed prefill of up to 3 prompts into fresh slots
        room = batch - len(live)
        new = [Seq(free.pop(0)) for _ in range(min(room, rng.randint(0, 3)))]
        if new:
            lens = [rng.randint(1, 150) for _ in new]
            x = _tokens(1, sum(lens), H, D, gen, device)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
            idx = torch.tensor([s.slot for s in new], device=device)
            pool[idx] = 0  # a recycled slot: a new sequence starts from the zero state
            o = kda_ops.chunk_kda_update_(*(x[n] for n in NAMES), pool, idx, cu_seqlens=cu, **OPTS)
            for i, s in enumerate(new):
                a, b = int(cu[i]), int(cu[i + 1])
                s.tokens.append({n: t[:, a:b] for n, t in x.items()})
                s.outputs.append(o[0, a:b])
            live += new
        if not live:
            continue
        rows = list(range(batch))
        rng.shuffle(rows)
        where = dict(zip(range(len(live)), rows))  # live sequence i sits in batch row where[i]
        if step % 3 == 2:  # verify T_spec drafts: the state after each into its own slot, from the current one
            x = _tokens(batch, T_spec, H, D, gen, device)
            idx = torch.full((batch, T_spec), -1, dtype=torch.int64)
            spare: dict[int, list[int]] = {}
            for i, s in enumerate(live):
                spare[i] = [free.pop(0) for _ in range(T_spec - 1)]
                idx[where[i]] = torch.tensor([s.slot, *spare[i]])
            acc = torch.ones(batch, dtype=torch.int64, device=device)
            o = st.run("verify", {**x, "idx": idx.to(device), "acc": acc})
            for i, s in enumerate(live):
                a = rng.randint(1, T_spec)
                r = where[i]
                s.tokens.append({n: t[r : r + 1, :a] for n, t in x.items()})
                s.outputs.append(o[r, :a])
                row = [s.slot, *spare[i]]
                s.slot = row[a - 1]
                free += [slot for j, slot in enumerate(row) if j != a - 1]
        else:  # decode one token
            x = _tokens(batch, 1, H, D, gen, device)
            idx = torch.full((batch,), -1, dtype=torch.int64)
            for i, s in enumerate(live):
                idx[where[i]] = s.slot
            o = st.run("decode", {**x, "idx": idx.to(device)})
            for i, s in enumerate(live):
                r = where[i]
                s.tokens.append({n: t[r : r + 1] for n, t in x.items()})
                s.outputs.append(o[r])
        # departures
        for s in [s for s in live if rng.random() < 0.1]:
            live.remove(s)
            free.append(s.slot)
            done.append(s)
    return done + live


def check_engine(seqs: list[Seq], tol: float, oracle: Callable[..., Any] = kda_ops.recurrent_kda) -> int:
    """Every sequence's kept outputs against ``oracle`` over its kept tokens from a zero state; returns the count."""
    for s in seqs:
        x = {n: torch.cat([t[n] for t in s.tokens], dim=1) for n in NAMES}
        o_ref, _ = oracle(**x, **OPTS)
        o = torch.cat(s.outputs, dim=0)
        assert rel_err(o, o_ref[0]) <= tol, (s.slot, rel_err(o, o_ref[0]))
    return len(seqs)
