"""Fast CUDA paths of the GDN ops: FLA's chunked kernel for prefill, our Triton kernel for decode.

Semantics and shapes are those of `deltaserve.kernels.gdn` (its torch references are the oracle).
"""

from __future__ import annotations

import torch

from deltaserve.kernels.pool_states import fla_cu_seqlens, gather_initial_states


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
) -> torch.Tensor:
    """Varlen prefill through FLA's `chunk_gated_delta_rule`, gathering and scattering pool slots.

    FLA takes no slot indices, so the initial states are gathered (zeros where a request starts
    fresh) and the final states scattered back; prefill is compute-bound, so the extra state
    traffic is small next to the chunked work.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    init = gather_initial_states(state_pool, slots, has_initial_state)
    with torch.no_grad():
        o, final = chunk_gated_delta_rule(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g=g.unsqueeze(0),
            beta=beta.unsqueeze(0),
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=fla_cu_seqlens(cu_seqlens),
        )
    state_pool.index_copy_(0, slots.long(), final.to(state_pool.dtype))
    return o[0].to(v.dtype)


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
    from deltaserve.kernels.triton_gdn import decode_block_v, gdn_decode_launch
    from deltaserve.kernels.triton_utils import sm_count

    n, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    assert q.shape == k.shape and hv % hk == 0, (q.shape, k.shape, v.shape)
    assert state_pool.stride(-1) == 1, "state pool rows must be contiguous"
    q, k, v, g, beta = (_last_dim_contiguous(t) for t in (q, k, v, g, beta))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    block_v, num_warps = decode_block_v(n, hv, dk, dv, sm_count(v.device))
    gdn_decode_launch(q, k, v, g, beta, state_pool, slots, out, block_v, num_warps, gates)
    return out
