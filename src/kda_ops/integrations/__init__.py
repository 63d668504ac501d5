"""Switches that put kda-ops under other libraries' models: :mod:`kda_ops.integrations.transformers` (Kimi Linear in
transformers) and :mod:`kda_ops.integrations.fla` (fla's KDA layer)."""
