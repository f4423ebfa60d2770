"""Gated delta rule (GDN): chunked prefill and one-step decode over a pool of states.

Shapes (token-major, FLA's convention): q, k `[T, Hk, K]`; v `[T, HV, V]` with HV a
multiple of Hk; g (log decay, <= 0) and beta `[T, HV]`; states `[S, HV, K, V]` in fp32.
q and k are L2-normalised inside the op and q is scaled by K ** -0.5.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.common.per_forward import PerForwardCache
from deltaserve.kernels.delta_rule.pool import prefill_each_sequence, step_slots
from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.gdn.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from deltaserve.kernels.norm import gdn_gates


def gdn_prefill(
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
    """Variable-length prefill of N sequences packed along T.

    Sequence i covers tokens `cu_seqlens[i]:cu_seqlens[i+1]`, starts from
    `state_pool[slots[i]]` when `has_initial_state[i]` (else from zeros) and leaves its final
    state in `state_pool[slots[i]]`. Returns o `[T, HV, V]` in v's dtype.
    `chunk_indices`: FLA's chunk indices for these sequences, built ahead (the fast path only).
    `cache`: the caller's, where the fast path keeps what it derives from `cu_seqlens`.
    """
    if use_fast_path(q):
        from deltaserve.kernels.gdn.cuda import gdn_prefill_cuda

        return gdn_prefill_cuda(
            q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial_state, chunk_indices, cache
        )
    return prefill_each_sequence(
        chunk_gated_delta_rule_ref, (q, k, v, g, beta), cu_seqlens, state_pool, slots, has_initial_state
    )


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token for each of N sequences, updating `state_pool[slots]` in place."""
    if use_fast_path(q):
        from deltaserve.kernels.gdn.cuda import gdn_decode_cuda

        return gdn_decode_cuda(q, k, v, g, beta, state_pool, slots)
    return step_slots(recurrent_gated_delta_rule_ref, (q, k, v, g, beta), state_pool, slots)


def gdn_decode_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`gdn_decode` from GDN's raw gate projections a, b `[N, HV]` (`kernels.norm.gdn_gates`);
    on CUDA the decode kernel computes the gates itself."""
    if use_fast_path(q):
        from deltaserve.kernels.gdn.cuda import gdn_decode_cuda

        return gdn_decode_cuda(q, k, v, a, b, state_pool, slots, gates=(A_log, dt_bias))
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return gdn_decode(q, k, v, g, beta, state_pool, slots)
