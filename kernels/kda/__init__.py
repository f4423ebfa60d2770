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
from deltaserve.kernels.delta_rule.reference import chunk_delta_rule_ref, recurrent_delta_rule_ref
from deltaserve.kernels.dispatch import use_fast_path


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KDA's q / k normalisation, in the form of FLA's kernels and transformers."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked (WY / UT form). Returns `(o [T, H, V], final_state [H, K, V])`."""
    return chunk_delta_rule_ref(q, k, v, g, beta, initial_state, l2norm, chunk_size)


def recurrent_kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of N sequences.

    q, k, g `[N, H, K]`, v `[N, H, V]`, beta `[N, H]`, state `[N, H, K, V]`.
    Returns `(o [N, H, V], new_state)`.
    """
    return recurrent_delta_rule_ref(q, k, v, g, beta, state, l2norm)


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
