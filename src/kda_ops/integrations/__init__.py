"""Switches that put kda-ops under other libraries' models: :mod:`kda_ops.integrations.transformers`."""
