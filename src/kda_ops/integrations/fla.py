"""kda-ops under fla's KDA layer: :func:`apply_kda_ops` swaps the kernels of ``fla.layers.kda.KimiDeltaAttention``
(flash-linear-attention) for kda-ops, as :mod:`kda_ops.integrations.transformers` does for transformers' layer.

fla's layer calls two module-level functions of ``fla.layers.kda``, ``chunk_kda`` (prefill, training) and
``fused_recurrent_kda`` (short inputs in inference), with fla's keywords (``state_v_first=True``, the gate, beta's
sigmoid and the l2norm in the kernel). Both names are rebound to :mod:`kda_ops.compat.fla`'s functions, which take
fla's signatures, so the layer's projections, short convolution, gated norm and cache stay fla's. The patch is
process-wide, as Liger-Kernel's are, and idempotent; :func:`remove_kda_ops` puts fla's kernels back.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from kda_ops.compat import fla as compat

LAYER_MODULE = "fla.layers.kda"
# the names fla's layer calls, and the kda-ops function each is rebound to
KERNELS = {"chunk_kda": compat.chunk_kda, "fused_recurrent_kda": compat.fused_recurrent_kda}
# fla's own functions, kept by the first patch for remove_kda_ops
_ORIGINALS: dict[str, Any] = {}


def _layer_module() -> Any:
    """``fla.layers.kda``; ImportError without flash-linear-attention, NotImplementedError for a layer module that
    does not call the kernels by the names kda-ops rebinds."""
    module = importlib.import_module(LAYER_MODULE)
    missing = [name for name in (*KERNELS, "KimiDeltaAttention") if not hasattr(module, name)]
    if missing:
        version = getattr(importlib.import_module("fla"), "__version__", "unknown")
        raise NotImplementedError(f"fla {version}: {LAYER_MODULE} has no {', '.join(missing)}; kda-ops knows the "
                                  "layer of flash-linear-attention 0.6, which calls chunk_kda and fused_recurrent_kda")
    return module


def apply_kda_ops(model: nn.Module | None = None) -> nn.Module | None:
    """Run the KDA of every ``fla.layers.kda.KimiDeltaAttention`` through kda-ops; returns ``model``.

    Raises ImportError without flash-linear-attention, NotImplementedError for a release whose layer module kda-ops
    does not know, ValueError when ``model`` (if given) holds no fla KDA layer."""
    module = _layer_module()
    if model is not None and not any(isinstance(m, module.KimiDeltaAttention) for m in model.modules()):
        raise ValueError(f"model: holds no fla KimiDeltaAttention ({type(model).__name__})")
    if not _ORIGINALS:
        _ORIGINALS.update({name: getattr(module, name) for name in KERNELS})
    for name, fn in KERNELS.items():
        setattr(module, name, fn)
    return model


def remove_kda_ops() -> None:
    """Give fla's layer its own kernels back (nothing if :func:`apply_kda_ops` never ran)."""
    module = importlib.import_module(LAYER_MODULE)
    for name, fn in _ORIGINALS.items():
        setattr(module, name, fn)
    _ORIGINALS.clear()


__all__ = ["apply_kda_ops", "remove_kda_ops"]
