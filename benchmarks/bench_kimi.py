"""A transformers Kimi Linear model three ways in one process: transformers' own PyTorch KDA path (unpatched), fla's
kernels (what transformers picks when fla is importable) and kda-ops (``apply_kda_ops``).

The model is a small random ``KimiLinearForCausalLM`` in bf16 (two KDA layers around one softmax-attention layer;
``--hidden``, ``--heads``, ``--head-dim``). Rows:

- logits of a ``--T``-token prompt (default 4096): each path's relative error ``||x - ref|| / ||ref||`` against the
  same model in float64 on transformers' PyTorch path, and kda-ops against the unpatched bf16 model;
- a ``--T``-token forward (no cache, ``do_bench`` median, GPU ms);
- a ``--decode``-token greedy ``generate()`` after a 16-token prompt (host ms per generated token, eager, the
  mean of 3 runs after one warm-up; the prompt's prefill included).

fla is imported from the environment, or from ``--wheels`` (default ``.whl/*.whl``) before transformers is, so that
transformers' kernel lookup finds it; ``--skip-fla`` leaves it out.

Usage: ``python benchmarks/bench_kimi.py [--out FILE] [--T 4096] [--decode 64] [--skip-fla]``; the markdown table
is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

from kda_ops.testing import rel_err  # noqa: E402

NAMES = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")


def model_for(modeling: Any, hidden: int, heads: int, head_dim: int) -> Any:
    """The random model, fp32 on the CPU, from seed 0 (each path gets a copy of the same weights)."""
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=3, num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=64,
        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, linear_num_heads=heads, linear_head_dim=head_dim,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "dense", "dense"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return modeling.KimiLinearForCausalLM(config).eval()


def use(modeling: Any, fns: tuple[Callable[..., Any], Callable[..., Any]]) -> None:
    for name, fn in zip(NAMES, fns, strict=True):
        setattr(modeling, name, fn)


def decode_ms(model: Any, prompt: torch.Tensor, n: int) -> float:
    """Host ms per generated token of a greedy ``generate()`` of ``n`` tokens (mean of 3 runs after a warm-up)."""
    def run() -> None:
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 3 / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _bench.table_and_wheel_arguments(parser)
    parser.add_argument("--skip-fla", action="store_true", help="leave fla out")
    parser.add_argument("--T", type=int, default=4096, help="tokens of the prompt of the forward rows")
    parser.add_argument("--decode", type=int, default=64, help="tokens generated in the decode row")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kimi: needs a CUDA GPU")
    from triton.testing import do_bench

    # fla first: transformers binds its kernel functions when its modeling module is imported
    fla_fn, fla_note = (None, "fla skipped") if args.skip_fla else _bench.load_fla(args.wheels, "chunk_kda")
    print(fla_note, file=sys.stderr)
    import transformers
    from transformers.models.kimi_linear import modeling_kimi_linear as modeling

    from kda_ops.integrations import transformers as integration

    bound = tuple(getattr(modeling, n) for n in NAMES)
    torch_path = tuple(inspect.unwrap(f) for f in bound)
    if any(f.__module__ != modeling.__name__ or f is b for f, b in zip(torch_path, bound, strict=True)):
        sys.exit("bench_kimi: transformers' own PyTorch KDA functions are not reachable behind its kernel lookup")
    paths: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {"transformers (PyTorch)": torch_path}
    if fla_fn is not None:
        paths["fla kernels"] = bound
    paths["kda-ops"] = (integration.chunk_kimi_delta_attention, integration.recurrent_kimi_delta_attention)

    base = model_for(modeling, args.hidden, args.heads, args.head_dim)
    ids = torch.randint(3, 1024, (1, args.T), generator=torch.Generator().manual_seed(1)).cuda()
    prompt = ids[:, :16]
    use(modeling, torch_path)
    with torch.no_grad():
        ref = base.double().cuda()(ids).logits
    model = base.to(torch.bfloat16)
    rows = []
    logits: dict[str, torch.Tensor] = {}
    for name, fns in paths.items():
        use(modeling, fns)
        with torch.no_grad():
            logits[name] = model(ids).logits
            fwd = float(do_bench(lambda: model(ids, use_cache=False), warmup=3, rep=200, return_mode="median"))
            dec = decode_ms(model, prompt, args.decode)
        rows.append((name, rel_err(logits[name], ref), fwd, dec))
        print(rows[-1], file=sys.stderr, flush=True)
    use(modeling, bound)
    diff = rel_err(logits["kda-ops"], logits["transformers (PyTorch)"])
    table = [
        f"# Kimi Linear under transformers, {datetime.date.today().isoformat()}",
        "",
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; transformers {transformers.__version__}; "
        f"{fla_note}. Model: hidden {args.hidden}, 3 layers (KDA, attention, KDA), {args.heads} KDA heads of "
        f"{args.head_dim}, bf16, random weights (seed 0); prompt B1 T{args.T}.",
        "",
        f"| KDA path | logits error vs float64 | forward T{args.T} GPU ms | decode ms / token ({args.decode} tokens) |",
        "|---|---|---|---|",
        *(f"| {n} | {e:.2e} | {f:.3f} | {d:.2f} |" for n, e, f, d in rows),
        "",
        f"kda-ops against the unpatched bf16 model: relative logits difference {diff:.2e}.",
    ]
    _bench.emit(table, args.out)


if __name__ == "__main__":
    main()
