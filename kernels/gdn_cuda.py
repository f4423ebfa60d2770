"""Fast CUDA paths of the GDN ops: FLA's chunked kernel for prefill, our Triton kernel for decode.

Semantics and shapes are those of `deltaserve.kernels.gdn` (its torch references are the oracle).
"""

from __future__ import annotations

import torch


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Kernels index the last dim with unit stride; views of fused projections keep it, so this
    # copies only in unusual cases.
    return t if t.stride(-1) == 1 else t.contiguous()


_cu_copy: tuple[torch.Tensor, int, torch.Tensor] | None = None


def _fla_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """An int64 copy of `cu_seqlens`, the same object for as long as the input is unchanged.

    FLA caches its chunk indices (built with a host sync) by argument identity alone: the
    same object for every layer of one forward keeps that to one sync per forward, and a new
    object whenever the input is refilled in place (its version counter moves) keeps FLA from
    reusing indices of an older batch.
    """
    global _cu_copy
    # inference tensors (the engine runs under inference_mode) keep no version counter; the
    # engine builds a new cu_seqlens tensor for every forward, so identity is enough there
    version = -1 if cu_seqlens.is_inference() else cu_seqlens._version
    if _cu_copy is None or _cu_copy[0] is not cu_seqlens or _cu_copy[1] != version:
        _cu_copy = (cu_seqlens, version, cu_seqlens.to(torch.int64, copy=True))
    return _cu_copy[2]


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

    idx = slots.long()
    init = state_pool.index_select(0, idx).float()
    # where, not multiply: an unused slot may hold garbage (NaN) that 0 * x would keep.
    fresh = ~has_initial_state.bool().view(-1, 1, 1, 1)
    init = torch.where(fresh, torch.zeros((), dtype=init.dtype, device=init.device), init)
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
            cu_seqlens=_fla_cu_seqlens(cu_seqlens),
        )
    state_pool.index_copy_(0, idx, final.to(state_pool.dtype))
    return o[0].to(v.dtype)


def gdn_decode_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step for N requests, updating `state_pool[slots]` in place.

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
    gdn_decode_launch(q, k, v, g, beta, state_pool, slots, out, block_v, num_warps)
    return out
