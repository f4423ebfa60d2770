"""Gated delta rule (GDN): chunked prefill and one-step decode over a pool of states.

Shapes (token-major, FLA's convention): q, k `[T, Hk, K]`; v `[T, HV, V]` with HV a
multiple of Hk; g (log decay, <= 0) and beta `[T, HV]`; states `[S, HV, K, V]` in fp32.
q and k are L2-normalised inside the op and q is scaled by K ** -0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.common.per_forward import PerForwardCache
from deltaserve.kernels.delta_rule.pool import prefill_each_sequence, step_slots
from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.norm import gdn_gates


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """Expand grouped heads, move to fp32 and `[H, T, D]`, normalise and scale q, k."""
    hv, hk = v.shape[-2], k.shape[-2]
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=-2)
        k = k.repeat_interleave(hv // hk, dim=-2)
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    q = l2norm(q)
    k = l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.transpose(0, 1).float(), beta.transpose(0, 1).float()


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked (WY / UT form). Returns `(o [T, HV, V], final_state [HV, K, V])`."""
    seq_len = q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    heads, _, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (seq_len + pad) // chunk_size
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, n, chunk_size, -1) for x in (q, k, k_beta, v_beta))
    g = g.reshape(heads, n, chunk_size).cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = prod of gates between j and i inside a chunk (causal part only)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    state = torch.zeros(heads, dk, dv, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        state = initial_state.float().clone()
    q_decayed = q * g.exp().unsqueeze(-1)
    k_to_end = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, dv)[:, :seq_len].transpose(0, 1)
    return out, state


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over a batch of one-token sequences.

    q, k `[N, Hk, K]`, v `[N, HV, V]`, g, beta `[N, HV]`, state `[N, HV, K, V]`.
    Returns `(o [N, HV, V], new_state)`.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [HV, N, D]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [N, HV, D]
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)
    s = state.float() * g.exp()[..., None, None]
    predicted = (s * k.unsqueeze(-1)).sum(-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(-2)
    return out, s


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
