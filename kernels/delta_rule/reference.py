"""The torch reference of the gated delta rule, for GDN and KDA alike (the CPU path and the oracle).

KDA decays the state per key channel: its log gate g is `[T, H, K]`. GDN is the same rule with
one log gate per head, `[T, H]`. Shapes are token-major (FLA's convention): q, k `[T, Hk, K]`;
v `[T, H, V]` with H a multiple of Hk (grouped heads are repeated); beta `[T, H]`; states
`[H, K, V]` in fp32. q and k are normalised by `qk_norm` (each model's own L2 form) and q is
scaled by K ** -0.5.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Norm = Callable[[torch.Tensor], torch.Tensor]


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, qk_norm: Norm
) -> tuple[torch.Tensor, ...]:
    """Grouped heads expanded, fp32, head-major `[H, T, ...]`, q and k normalised, q scaled."""
    heads, groups = v.shape[-2], k.shape[-2]
    if heads != groups:
        q = q.repeat_interleave(heads // groups, dim=-2)
        k = k.repeat_interleave(heads // groups, dim=-2)
    q, k, v, g, beta = (x.transpose(0, 1).float() for x in (q, k, v, g, beta))
    q = qk_norm(q) * q.shape[-1] ** -0.5
    return q, qk_norm(k), v, g, beta


def _chunk_terms(
    q: torch.Tensor, k: torch.Tensor, k_beta: torch.Tensor, g: torch.Tensor, upper: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """One chunk's decayed products from its cumulative log gates g (`[H, C]` per head or
    `[H, C, K]` per channel): (k_beta k^T, q k^T) under the causal decay, the decay from the
    chunk's start per position, keys decayed to the chunk's end, the state's decay over it."""
    if g.dim() == 2:  # one gate per head: the decay factors out of the key products
        decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
        system = (k_beta @ k.transpose(-1, -2)) * decay
        intra = (q @ k.transpose(-1, -2)) * decay
        g_last = g[..., -1:]
        return (
            system,
            intra,
            g.exp().unsqueeze(-1),
            k * (g_last - g).exp().unsqueeze(-1),
            g_last.exp()[..., None],
        )
    # per channel it does not: exp(g_a - g_b) for b <= a, as factors it would overflow exp(-g)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()
    system = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)
    intra = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)
    g_last = g[:, -1:]  # [H, 1, K]
    return system, intra, g.exp(), k * (g_last - g).exp(), g_last.transpose(-1, -2).exp()


def chunk_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    qk_norm: Norm,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked (WY / UT form). Returns `(o [T, H, V], final_state [H, K, V])`."""
    seq_len = q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, qk_norm)
    heads, _, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g = F.pad(g, (0, pad) if g.dim() == 2 else (0, 0, 0, pad))
    beta = F.pad(beta, (0, pad))
    n = (seq_len + pad) // chunk_size
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, n, chunk_size, -1) for x in (q, k, k_beta, v_beta))
    g = g.reshape(heads, n, chunk_size, *g.shape[2:]).cumsum(2)  # from each chunk's start
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    state = torch.zeros(heads, dk, dv, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        state = initial_state.float().clone()
    out = torch.empty(heads, n, chunk_size, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        system, intra, g_exp, k_to_end, state_decay = _chunk_terms(
            q[:, i], k[:, i], k_beta[:, i], g[:, i], upper
        )
        u = torch.linalg.solve_triangular(system, v_beta[:, i], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta[:, i] * g_exp, upper=False, unitriangular=True)
        v_new = u - w @ state
        out[:, i] = (q[:, i] * g_exp) @ state + intra @ v_new
        state = state * state_decay + k_to_end.transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, dv)[:, :seq_len].transpose(0, 1)
    return out, state


def recurrent_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    qk_norm: Norm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of N sequences: q, k `[N, Hk, K]`, v `[N, H, V]`, g `[N, H]` or
    `[N, H, K]`, beta `[N, H]`, state `[N, H, K, V]`. Returns `(o [N, H, V], new_state)`."""
    q, k, v, g, beta = (x.transpose(0, 1) for x in _prepare(q, k, v, g, beta, qk_norm))  # [N, H, ...]
    decay = g.exp()[..., None, None] if g.dim() == 2 else g.exp().unsqueeze(-1)
    s = state.float() * decay
    predicted = (s * k.unsqueeze(-1)).sum(-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(-2)
    return out, s
