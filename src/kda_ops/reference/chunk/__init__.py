"""The chunkwise form of KDA and its analytic backward in plain PyTorch, one module per stage of the Triton chunk
pipeline (:mod:`kda_ops.triton.chunk`), under the same module names.

Notation of ``docs/math.md`` ("The chunkwise form"), per value head, ``C`` tokens a chunk, incoming state
``S [K, V]``::

    Gam_i  = sum_{j<=i} g_j                        chunk-local cumulative log decay
    Mkk    = beta_i sum_d k_id k_jd exp(Gam_id - Gam_jd), j < i;   Mqk likewise with s q_i, j <= i
    Tm     = (I + Mkk)^-1                          unit lower triangular
    W      = Tm diag(beta) Kt,  U = Tm diag(beta) V    (Kt = k exp(Gam))
    E      = U - W S                               resolved errors
    O      = Qt S + Mqk E                          (Qt = s q exp(Gam))
    S'     = diag(exp(Gam_last)) S + Kend^T E      (Kend = k exp(Gam_last - Gam))

The stages and their oracles:

- :mod:`.decays`: ``Gam`` and ``Gam_last`` (:func:`~.decays.decays`).
- :mod:`.intra`: ``Mqk``, ``Mkk``, ``Qt``, ``Kend`` (:func:`~.intra.intra`).
- :mod:`.solve`: ``Tm = (I + Mkk)^-1`` and the WY factors ``W``, ``U`` (:func:`~.solve.solve`).
- :mod:`.prepare`: the prepared inputs (:func:`~.prepare.prepare_flat`) and the X form of the fused prepare
  kernel (:func:`~.prepare.x_form`).
- :mod:`.scan`: the inter-chunk state scan, ``Hin`` and ``E`` (:func:`~.scan.scan`).
- :mod:`.output`: ``O = Qt S + Mqk E`` (:func:`~.output.output`).
- :mod:`.forward`: the whole forward, the CPU kernel of ``torch.ops.kda.chunk`` (:func:`~.forward.chunk_fwd`).
- :mod:`.scan_bwd`, :mod:`.dv`, :mod:`.dqk`: the backward's stages (:func:`~.scan_bwd.scan_bwd`,
  :func:`~.dv.dv`, :func:`~.dqk.dqk`).
- :mod:`.backward`: the whole analytic backward, the CPU backward of both ops (:func:`~.backward.chunk_bwd`).
- :mod:`.common`: the chunk-slot layout and the pairwise decays every stage shares.

Tokens are gathered into a static number of chunk slots (:mod:`kda_ops.varlen`), so no value is read on the host.
Pairwise decays are formed from differences ``Gam_i - Gam_j <= 0`` only, never from ``exp(-Gam)``.
"""
