"""The recurrent schedule in plain PyTorch, mirroring :mod:`kda_ops.triton.recurrent`: :mod:`.forward` holds the
forward and the serving step (the backward of the recurrent op is the chunkwise one,
:mod:`kda_ops.reference.chunk.backward`).
"""
