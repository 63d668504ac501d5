"""Drop-in names of other KDA libraries on kda-ops' public functions.

:mod:`kda_ops.compat.fla`: ``chunk_kda``, ``fused_recurrent_kda`` and ``fused_kda_gate`` with the signatures of
fla-core's ``fla.ops.kda`` (0.6.0), so that a model switches by changing one import.
"""
