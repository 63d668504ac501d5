"""One packed row of sequences split over the ranks of a job, forward and backward, checked against one process.

    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py          # CPU, gloo
    torchrun --standalone --nproc-per-node 4 examples/context_parallel.py --cuda   # one GPU per rank, NCCL

Every rank builds the same whole row (same seed), keeps its slice of the tokens, runs
``kda_ops.distributed.chunk_kda`` and compares its outputs, the final states and its slice of the gradients with
``kda_ops.chunk_kda`` on the whole row; rank 0 prints the largest relative error.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import kda_ops
from kda_ops import distributed
from kda_ops.testing import make_inputs, rel_err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank and NCCL (else CPU and gloo)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the whole row")
    args = parser.parse_args()
    cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same cotangents on every rank

    # three sequences in one row, cut at arbitrary points: the middle one crosses every rank boundary
    T = args.tokens
    x = make_inputs(1, T, 2, 32, 32, dtype=torch.float32, device=device, gate_in_kernel=True)
    cu = torch.tensor([0, T // 8, T - T // 8, T], dtype=torch.int32, device=device)
    opts = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, output_final_state=True)
    leaves = list(x.values())
    for t in leaves:
        t.requires_grad_()
    o, final = kda_ops.chunk_kda(**x, **opts)
    do = torch.randn_like(o)
    want = torch.autograd.grad((o * do).sum() + final.sum(), leaves)

    lo, hi = rank * T // world, (rank + 1) * T // world  # this rank's slice of the tokens
    mine = {n: (t.detach()[:, lo:hi] if t.dim() == 4 or t.dim() == 3 else t.detach()).clone().requires_grad_()
            for n, t in x.items()}  # fmt: skip
    o_r, final_r = distributed.chunk_kda(**mine, **opts)
    # the final states are the same on every rank: count their loss once
    loss = (o_r * do[:, lo:hi]).sum() + (final_r.sum() if rank == world - 1 else 0)
    got = torch.autograd.grad(loss, list(mine.values()))

    errors = {"o": rel_err(o_r, o[:, lo:hi]), "final_state": rel_err(final_r, final)}
    for (name, t), g_r, g in zip(mine.items(), got, want):
        if t.dim() >= 3:  # a slice of the tokens
            errors[f"d{name}"] = rel_err(g_r, g[:, lo:hi])
        else:  # A_log, dt_bias: shared by the ranks, their gradients add up
            dist.all_reduce(g_r)
            errors[f"d{name}"] = rel_err(g_r, g)
    worst = torch.tensor([max(errors.values())], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{world} ranks, {T} tokens: largest relative error against one process {worst.item():.1e}")
    # every rank done before any tears its connections down: a gloo peer that closes them while another is still
    # reading can abort that one's process
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
