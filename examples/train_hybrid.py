"""Train a small hybrid language model (Kimi Linear KDA layers around one softmax-attention layer) end to end on
synthetic data under ``torch.compile``, and time it against the same model with transformers' own KDA path (and
fla's KDA kernels where fla is installed).

The task needs a memory that a short convolution lacks: each sequence repeats a random block of ``PERIOD`` tokens,
and the loss is the next-token cross entropy after the first block (its floor is 0; guessing gives
``log(VOCAB)``). Every model starts from the same weights and sees the same batches; transformers' path runs eager
(see ``main``).

Usage: ``python examples/train_hybrid.py [--steps 300] [--device cpu|cuda] [--out DIR]``; writes
``train_hybrid_loss.png`` and ``train_hybrid.md`` (the loss and tokens/s table) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kda_ops
from kda_ops.nn import KimiDeltaAttention

VOCAB, HIDDEN, HEADS, HEAD_DIM = 64, 128, 2, 64
PERIOD = 8  # tokens per repeated block: beyond the short convolution's reach (3 tokens back)


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.gate = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    """Causal softmax attention (SDPA), the hybrid's global layer."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, d))


class TransformersKDA(nn.Module):
    """transformers' ``KimiLinearDeltaAttention`` holding the same parameters as a :class:`KimiDeltaAttention`
    (its state dict loads unchanged), for the comparison."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.layer(x)
        return y


class Block(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.mixer, self.mlp = mixer, MLP(HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        y = self.mixer(self.norm1(x))
        x = x + (y[0] if isinstance(y, tuple) else y)
        return x + self.mlp(self.norm2(x))


class HybridLM(nn.Module):
    """Embedding, KDA block, attention block, KDA block, norm, output projection."""

    def __init__(self, kda: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(kda()), Block(Attention(HIDDEN, HEADS)), Block(kda())])
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def ours() -> nn.Module:
    return KimiDeltaAttention(HIDDEN, HEADS, HEAD_DIM)


def transformers_kda() -> nn.Module:
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    config = KimiLinearConfig(hidden_size=HIDDEN, linear_num_heads=HEADS, linear_head_dim=HEAD_DIM,
                              num_hidden_layers=1, layer_types=["linear_attention"])  # fmt: skip
    return TransformersKDA(KimiLinearDeltaAttention(config, 0))


KERNEL_NAMES = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")


def transformers_paths(device: str) -> dict[str, tuple[Callable[..., Any], ...]]:
    """transformers' KDA functions by path: its own PyTorch ones, and on CUDA the kernels it bound at import (fla's,
    when fla imports: fla's kernels run on CUDA only)."""
    import inspect

    from transformers.models.kimi_linear import modeling_kimi_linear as modeling

    bound = tuple(getattr(modeling, n) for n in KERNEL_NAMES)
    paths = {"transformers KDA path, eager": tuple(inspect.unwrap(f) for f in bound)}
    if device.startswith("cuda") and _fla_imports():
        paths["transformers layer on fla's kernels, eager"] = bound
    return paths


def _fla_imports() -> bool:
    """Whether fla's KDA functions import (transformers' wrappers fall back to its PyTorch ones where they do not)."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        importlib.import_module("fla.ops.kda")
    except Exception:  # noqa: BLE001 - any failure means transformers cannot bind fla's kernels either
        return False
    return True


@contextlib.contextmanager
def kernels(fns: tuple[Callable[..., Any], ...]) -> Iterator[None]:
    """transformers' KDA layers call ``fns`` inside the block (its module-level names, looked up per call)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as modeling

    old = tuple(getattr(modeling, n) for n in KERNEL_NAMES)
    for n, f in zip(KERNEL_NAMES, fns, strict=True):
        setattr(modeling, n, f)
    try:
        yield
    finally:
        for n, f in zip(KERNEL_NAMES, old, strict=True):
            setattr(modeling, n, f)


def init_like(model: HybridLM, ref: dict[str, Tensor]) -> HybridLM:
    """``model`` with the weights ``ref`` (a state dict; the KDA layers' keys are the same either way)."""
    own = model.state_dict()
    mapped = {}
    for name in own:
        src = name.replace(".layer.", ".")
        mapped[name] = ref[src]
    model.load_state_dict(mapped)
    return model


def kda_init(model: HybridLM) -> HybridLM:
    """The KDA layers' gate parameters as Kimi Linear initialises them (decay rates in [1, 16], softplus(dt_bias)
    in [1e-3, 1e-1])."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, KimiDeltaAttention):
                m.forget_gate.A_log.copy_(torch.log(torch.linspace(1.0, 16.0, HEADS)).view(1, 1, HEADS, 1))
                dt = torch.exp(torch.rand(HEADS * HEAD_DIM) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                m.forget_gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    return model


def batches(steps: int, B: int, T: int, device: str) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        block = torch.randint(0, VOCAB, (B, PERIOD), generator=gen)
        out.append(block.repeat(1, -(-T // PERIOD))[:, :T].to(device))
    return out


def train(name: str, model: nn.Module, data: list[Tensor], device: str, compile: bool) -> dict[str, Any]:
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step_fn = torch.compile(model) if compile else model
    losses: list[float] = []
    t_start = 0.0
    warm = 5
    for i, ids in enumerate(data):
        if i == warm:
            if device == "cuda":
                torch.cuda.synchronize()
            t_start = time.perf_counter()
        logits = step_fn(ids[:, :-1])
        loss = F.cross_entropy(logits[:, PERIOD - 1 :].reshape(-1, VOCAB), ids[:, PERIOD:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # sync-ok: an example's log
    if device == "cuda":
        torch.cuda.synchronize()
    tokens = sum(ids.numel() for ids in data[warm:])
    bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    return {"name": name, "losses": losses, "tok_s": tokens / (time.perf_counter() - t_start), "first_nan": bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("docs"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    torch.manual_seed(0)
    base = kda_init(HybridLM(ours))
    start = {n: t.clone() for n, t in base.state_dict().items()}
    data = batches(args.steps, args.batch, args.T, args.device)
    # transformers' KDA path runs eager: its PyTorch chunk loop (63 row updates per chunk, a loop over chunks)
    # unrolls under torch.compile into a graph that takes longer to compile than the training run
    runs = [train("kda-ops, compiled", base, data, args.device, compile=True)]
    fresh = init_like(HybridLM(ours), start)
    runs.append(train("kda-ops, eager", fresh, data, args.device, compile=False))
    try:
        paths = transformers_paths(args.device)
    except ImportError as e:
        print(f"transformers' layer skipped: {e}")
        paths = {}
    for name, fns in paths.items():
        try:
            with kernels(fns):
                theirs = init_like(HybridLM(transformers_kda), start)
                runs.append(train(name, theirs, data, args.device, compile=False))
        except Exception as e:  # noqa: BLE001 - a peer path that fails is reported, the others still run
            print(f"{name} failed: {type(e).__name__}: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in runs:
        ax.plot(r["losses"], label=r["name"], lw=1)
    ax.axhline(math.log(VOCAB), color="grey", ls=":", lw=1, label="guessing")
    ax.set_xlabel("step")
    ax.set_ylabel("recall loss")
    ax.set_title(f"hybrid LM, B{args.batch} T{args.T}, {args.device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "train_hybrid_loss.png", dpi=120)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [f"{when}, {dev}, torch {torch.__version__}, kda-ops {kda_ops.__version__}, {args.steps} steps of "
             f"B{args.batch} T{args.T}", "", "| KDA | first loss | last loss (mean of 10) | tokens/s |",
             "|---|---|---|---|"]  # fmt: skip
    for r in runs:
        bad = r["first_nan"]
        last = f"{sum(r['losses'][-10:]) / 10:.3f}" if bad is None else f"non-finite from step {bad}"
        lines.append(f"| {r['name']} | {r['losses'][0]:.3f} | {last} | {r['tok_s']:.0f} |")
    text = "\n".join(lines)
    (args.out / "train_hybrid.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
