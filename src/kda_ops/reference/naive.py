"""The naive KDA recurrence, token by token: the oracle every schedule is checked against.

Written for clarity, not speed: it loops over sequences and tokens in Python and reads ``cu_seqlens`` on the
host. It is an oracle for tests, never on an op's call path (the ops use :mod:`kda_ops.reference.recurrent.forward`
and :mod:`kda_ops.reference.chunk.forward`, which never read tensor values on the host).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda_ops.common import Options, state_dtype
from kda_ops.reference.inputs import transform_inputs
from kda_ops.reference.threads import loop_threads


def naive_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """KDA by its definition (``docs/math.md``, "The recurrence"); same arguments and results as ``kda_ops.chunk_kda``.

    Differentiable with ``torch.autograd``: in float64 it is the oracle for the gradients too.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    dtype = state_dtype(v)
    opts = Options(
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound
    )
    qp, kp, gp, bp = transform_inputs(q, k, g, beta, A_log, dt_bias, opts, dtype)
    qp = qp.repeat_interleave(HV // H, dim=2)
    kp = kp.repeat_interleave(HV // H, dim=2)
    vp = v.to(dtype)
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()  # sync-ok: oracle only, never on an op call path
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    outs = torch.zeros(B, T, HV, V, dtype=dtype, device=v.device)
    o_rows: list[list[Tensor]] = [[] for _ in range(B)]
    finals = []
    with loop_threads(HV * K * V):
        for n, (b, t0, t1) in enumerate(bounds):
            S = torch.zeros(HV, K, V, dtype=dtype, device=v.device)
            if initial_state is not None:
                S = initial_state[n].to(dtype)
            for t in range(t0, t1):
                S = S * gp[b, t].exp().unsqueeze(-1)
                prediction = torch.einsum("hkv,hk->hv", S, kp[b, t])
                residual = bp[b, t].unsqueeze(-1) * (vp[b, t] - prediction)
                S = S + torch.einsum("hk,hv->hkv", kp[b, t], residual)
                o_rows[b].append(torch.einsum("hk,hkv->hv", qp[b, t] * scale, S))
            finals.append(S)
    if cu_seqlens is None:
        o = torch.stack([torch.stack(rows) for rows in o_rows]) if B > 0 and T > 0 else outs
    else:
        o = torch.stack(o_rows[0]).unsqueeze(0) if o_rows[0] else outs
        if len(o_rows[0]) != T:  # tokens outside [cu[0], cu[-1]) are untouched: zero rows
            o = torch.cat([outs[:, : cu[0]], o, outs[:, cu[-1] :]], dim=1)
    final = (torch.stack(finals) if finals else outs.new_zeros(0, HV, K, V)) if output_final_state else None
    return o.to(v.dtype), final
