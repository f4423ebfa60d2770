"""Fast CUDA paths of the KDA ops: FLA's `chunk_kda` for prefill, FLA's slot-indexed recurrent
kernel for decode.

Semantics and shapes are those of `deltaserve.kernels.kda` (its torch references are the oracle).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from deltaserve.kernels.common.per_forward import PerForwardCache
from deltaserve.kernels.delta_rule.fla import fla_chunk_forward, fla_cu_seqlens, fla_internal, import_fla
from deltaserve.kernels.delta_rule.pool import gather_initial_states, long_slots


def kda_prefill_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_indices: torch.Tensor | None = None,
    cache: PerForwardCache | None = None,
) -> torch.Tensor:
    """Varlen prefill through FLA's `chunk_kda`, gathering and scattering pool slots.

    `chunk_kda` takes no slot indices (and asserts an fp32 initial state), so the initial
    states are gathered as fp32, zeros where a request starts fresh, and the final states
    scattered back; prefill is compute-bound, so the extra state traffic is small.
    """
    init = gather_initial_states(state_pool, slots, has_initial_state, cache)
    cu = fla_cu_seqlens(cu_seqlens, cache)
    direct = _kda_forward()
    if direct is not None:
        o, final = direct(q, k, v, g, beta, init, cu, chunk_indices)
        state_pool.index_copy_(0, long_slots(slots, cache), final.to(state_pool.dtype))
        return o[0].to(v.dtype)
    chunk_kda = import_fla("fla.ops.kda").chunk_kda
    with torch.no_grad():
        o, final = chunk_kda(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g=g.float().unsqueeze(0),
            beta=beta.unsqueeze(0),
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
        )
    state_pool.index_copy_(0, slots.long(), final.to(state_pool.dtype))
    return o[0].to(v.dtype)


@functools.cache
def _kda_forward() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """FLA's chunked KDA forward below its public entry (as `gdn.cuda._fla_forward` does for
    GDN): no autograd Function or argument checks, q / k normalised and v made contiguous by
    one kernel of ours, chunk indices once per forward. None with DELTASERVE_FLA_DIRECT=0 or an
    FLA whose internals differ from 0.6's."""
    fwd = fla_internal("fla.ops.kda.chunk_fwd", "chunk_kda_fwd")
    if fwd is None:
        return None

    def forward(q, k, v, g, beta, init, cu, chunk_indices=None):  # type: ignore[no-untyped-def]
        out = fla_chunk_forward(fwd, q, k, v, g.float(), beta, init, cu, chunk_indices)  # KDA's gates in fp32
        return out[0], out[1]  # (o, final_state, ...)

    return forward


def kda_decode_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step for N requests, updating `state_pool[slots]` in place.

    FLA's internal `fused_recurrent_kda_fwd` reads and writes the pool through
    `ssm_state_indices` (its continuous-batching mode), so nothing is gathered or scattered.
    Each request is a batch row of one token (no cu_seqlens): no host syncs, launch
    parameters depend on shapes only, so it is CUDA-graph safe.
    """
    fused_recurrent_kda_fwd = import_fla("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd
    assert state_pool.dtype == torch.float32 and state_pool.is_contiguous(), "KDA decode needs an fp32 pool"
    # the kernel assumes packed rows; views of fused projections are not
    q, k, v, g, beta = (x.contiguous().unsqueeze(1) for x in (q, k, v, g.float(), beta))
    out, _ = fused_recurrent_kda_fwd(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=state_pool,
        inplace_final_state=True,
        ssm_state_indices=slots.to(torch.int32),
        use_qk_l2norm_in_kernel=True,
    )
    return out[:, 0]
