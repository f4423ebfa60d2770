"""Kimi Delta Attention (KDA): chunked prefill and one-step decode over a pool of states.

KDA is the gated delta rule with a per-channel decay: the log gate g is `[T, H, K]`
(one value per key channel) where GDN has one per head. Shapes are token-major (FLA's
convention): q, k `[T, H, K]`; v `[T, H, V]`; g (log decay, <= 0) `[T, H, K]`; beta `[T, H]`;
states `[S, H, K, V]` in fp32. q and k are L2-normalised inside the op (as `x / sqrt(|x|^2 +
eps)`, the form FLA's kernels and transformers use) and q is scaled by K ** -0.5.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.common.per_forward import PerForwardCache
from deltaserve.kernels.delta_rule.pool import prefill_each_sequence, step_slots
from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.kda.reference import chunk_kda_ref, recurrent_kda_ref


def kda_prefill(
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
    state in `state_pool[slots[i]]`. Returns o `[T, H, V]` in v's dtype.
    `chunk_indices`: FLA's chunk indices for these sequences, built ahead (the fast path only).
    `cache`: the caller's, where the fast path keeps what it derives from `cu_seqlens`.
    """
    if use_fast_path(q):
        from deltaserve.kernels.kda.cuda import kda_prefill_cuda

        return kda_prefill_cuda(
            q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial_state, chunk_indices, cache
        )
    return prefill_each_sequence(
        chunk_kda_ref, (q, k, v, g, beta), cu_seqlens, state_pool, slots, has_initial_state
    )


def kda_decode(
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
        from deltaserve.kernels.kda.cuda import kda_decode_cuda

        return kda_decode_cuda(q, k, v, g, beta, state_pool, slots)
    return step_slots(recurrent_kda_ref, (q, k, v, g, beta), state_pool, slots)
