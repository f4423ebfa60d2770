"""Kimi Delta Attention (KDA): chunked prefill and one-step decode over a pool of states.

KDA is the gated delta rule with a per-channel decay: the log gate g is `[T, H, K]`
(one value per key channel) where GDN has one per head. Shapes are token-major (FLA's
convention): q, k `[T, H, K]`; v `[T, H, V]`; g (log decay, <= 0) `[T, H, K]`; beta `[T, H]`;
states `[S, H, K, V]` in fp32. q and k are L2-normalised inside the op (as `x / sqrt(|x|^2 +
eps)`, the form FLA's kernels and transformers use) and q is scaled by K ** -0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.common.per_forward import PerForwardCache
from deltaserve.kernels.delta_rule.pool import prefill_each_sequence, step_slots
from deltaserve.kernels.dispatch import use_fast_path


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """fp32, head-major `[H, T, D]`, q and k normalised, q scaled."""
    q, k, v, g = (x.transpose(0, 1).float() for x in (q, k, v, g))
    q = l2norm(q) * q.shape[-1] ** -0.5
    return q, l2norm(k), v, g, beta.transpose(0, 1).float()


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
    seq_len = q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    heads, _, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    n = (seq_len + pad) // chunk_size
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    q, k, v_beta, k_beta, g = (x.reshape(heads, n, chunk_size, -1) for x in (q, k, v_beta, k_beta, g))
    # cumulative log decay inside each chunk, per key channel
    g = g.cumsum(-2)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    state = torch.zeros(heads, dk, dv, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        state = initial_state.float().clone()
    out = torch.empty(heads, n, chunk_size, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        gi = g[:, i]
        # decay[h, a, b, d] = exp(g_a - g_b) for b <= a; the gates differ per channel, so it
        # cannot be factored into the two operands without exp(-g) overflowing.
        decay = (gi.unsqueeze(-2) - gi.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()
        system = (k_beta[:, i].unsqueeze(-2) * k[:, i].unsqueeze(-3) * decay).sum(-1)
        intra = (q[:, i].unsqueeze(-2) * k[:, i].unsqueeze(-3) * decay).sum(-1)
        u = torch.linalg.solve_triangular(system, v_beta[:, i], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta[:, i] * gi.exp(), upper=False, unitriangular=True)
        v_new = u - w @ state
        out[:, i] = (q[:, i] * gi.exp()) @ state + intra @ v_new
        g_last = gi[:, -1:]  # [H, 1, K]
        k_to_end = k[:, i] * (g_last - gi).exp()
        state = state * g_last.transpose(-1, -2).exp() + k_to_end.transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, dv)[:, :seq_len].transpose(0, 1)
    return out, state


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
    q, k, v, g, beta = (x.transpose(0, 1) for x in _prepare(q, k, v, g, beta))  # back to [N, H, D]
    s = state.float() * g.exp().unsqueeze(-1)
    predicted = (s * k.unsqueeze(-1)).sum(-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(-2)
    return out, s


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
