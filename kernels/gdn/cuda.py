"""Fast CUDA paths of the GDN ops: FLA's chunked kernel for prefill, our Triton kernel for decode.

Semantics and shapes are those of `deltaserve.kernels.gdn` (its torch references are the oracle).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from deltaserve.kernels.common.per_forward import PerForwardCache
from deltaserve.kernels.delta_rule.fla import fla_chunk_forward, fla_cu_seqlens, fla_internal, import_fla
from deltaserve.kernels.delta_rule.pool import gather_initial_states, long_slots


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Kernels index the last dim with unit stride; views of fused projections keep it, so this
    # copies only in unusual cases.
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_prefill_cuda(
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
    """Varlen prefill through FLA's `chunk_gated_delta_rule`, gathering and scattering pool slots.

    FLA takes no slot indices, so the initial states are gathered (zeros where a request starts
    fresh) and the final states scattered back; prefill is compute-bound, so the extra state
    traffic is small next to the chunked work.
    """
    init = gather_initial_states(state_pool, slots, has_initial_state, cache)
    cu = fla_cu_seqlens(cu_seqlens, cache)
    direct = _fla_forward()
    if direct is not None:
        o, final = direct(q, k, v, g, beta, init, cu, chunk_indices)
    else:
        o, final = _fla_public(q, k, v, g, beta, init, cu)
    state_pool.index_copy_(0, long_slots(slots, cache), final.to(state_pool.dtype))
    return o[0].to(v.dtype)


def _fla_public(q, k, v, g, beta, init, cu):  # type: ignore[no-untyped-def]
    """FLA's public `chunk_gated_delta_rule` (its autograd Function, guards and dispatch)."""
    chunk_gated_delta_rule = import_fla("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    with torch.no_grad():
        return chunk_gated_delta_rule(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g=g.unsqueeze(0),
            beta=beta.unsqueeze(0),
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
        )


@functools.cache
def _fla_forward() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """FLA's chunked GDN forward called below its public entry point: no autograd Function, no
    backend dispatch, no argument guards (the public call's host time per layer bounds a small
    model's prefill, docs/performance.md, "Environment switches"), with FLA's chunk indices built
    once per forward (cached by `cu_seqlens` identity, as FLA does). None with
    DELTASERVE_FLA_DIRECT=0, or an FLA whose internals differ from 0.6's (the public call then)."""
    fwd = fla_internal("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule_fwd")
    if fwd is None:
        return None

    def forward(q, k, v, g, beta, init, cu, chunk_indices=None):  # type: ignore[no-untyped-def]
        # the steps of FLA's ChunkGatedDeltaRuleFunction.forward with use_qk_l2norm_in_kernel=True
        out = fla_chunk_forward(fwd, q, k, v, g, beta, init, cu, chunk_indices)
        return out[1], out[3]  # (g, o, A, final_state, ...)

    return forward


def gdn_decode_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    gates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decode step for N requests, updating `state_pool[slots]` in place. With
    `gates=(A_log, dt_bias)`, g and beta are GDN's raw gate projections a and b `[N, HV]`, and
    the kernel computes the gates itself (one launch fewer per layer and step).

    CUDA-graph safe: no host syncs, and every launch parameter depends on shapes only.
    """
    from deltaserve.kernels.common.launch import sm_count
    from deltaserve.kernels.gdn.triton import decode_block_v, gdn_decode_launch

    n, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    assert q.shape == k.shape and hv % hk == 0, (q.shape, k.shape, v.shape)
    assert state_pool.stride(-1) == 1, "state pool rows must be contiguous"
    q, k, v, g, beta = (_last_dim_contiguous(t) for t in (q, k, v, g, beta))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    block_v, num_warps = decode_block_v(n, hv, dk, dv, sm_count(v.device))
    gdn_decode_launch(q, k, v, g, beta, state_pool, slots, out, block_v, num_warps, gates)
    return out
