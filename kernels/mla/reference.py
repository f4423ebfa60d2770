"""The torch references of multi-head latent attention (the CPU path and the oracle), in both
formulations `deltaserve.kernels.mla` describes, and the paged-latent helpers they share with the
fast paths of `mla/cuda.py`.
"""

from __future__ import annotations

import torch


def _gather(cache: torch.Tensor, pages: torch.Tensor, total: int) -> torch.Tensor:
    page_size = cache.shape[1]
    pos = torch.arange(total, device=cache.device)
    return cache[pages[pos // page_size].long(), pos % page_size]  # [S, L + R]


def _causal_mask(total: int, q_len: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(total, device=device)
    q_pos = torch.arange(total - q_len, total, device=device)
    return pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [Tq, S], True where masked


RequestBounds = tuple[int, int, int, int]  # (request, first query row, end query row, KV length)


def request_bounds(bounds: list[int], kv_lens: list[int], first: int = 0) -> list[RequestBounds]:
    """Each request from `first` on with queries: `bounds` are the query rows' cumulative starts."""
    return [
        (i, bounds[i], bounds[i + 1], kv_lens[i])
        for i in range(first, len(kv_lens))
        if bounds[i + 1] > bounds[i]
    ]


def _requests(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, first: int = 0) -> list[RequestBounds]:
    """`request_bounds` of the batch's tensors (read back from the device)."""
    return request_bounds(cu_seqlens_q.tolist(), seq_lens.tolist(), first)


def _expanded_kv(
    latent: torch.Tensor, w_kv_b: torch.Tensor, heads: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's cached latents `[S, L + R]` as per-head keys `[S, H, nope + R]` (k_pe shared
    by every head) and values `[S, H, v_head_dim]`, in the dtypes given."""
    total, latent_dim = latent.shape[0], w_kv_b.shape[1]
    rope = latent.shape[1] - latent_dim
    c, k_pe = latent.split([latent_dim, rope], dim=-1)
    kv = (c @ w_kv_b.t()).view(total, heads, -1)
    k_nope, v = kv.split([kv.shape[-1] - v_head_dim, v_head_dim], dim=-1)
    return torch.cat([k_nope, k_pe.unsqueeze(1).expand(total, heads, rope)], dim=-1), v


def mla_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
) -> torch.Tensor:
    """Expanded form. q `[T, H, nope + R]` packed over N requests; returns `[T, H, v_head_dim]`."""
    heads = q.shape[1]
    out = q.new_empty(q.shape[0], heads, v_head_dim)
    for i, lo, hi, total in _requests(cu_seqlens_q, seq_lens):
        k, v = _expanded_kv(_gather(cache, page_table[i], total), w_kv_b, heads, v_head_dim)
        scores = q[lo:hi].transpose(0, 1).float() @ k.permute(1, 2, 0).float() * scale  # [H, Tq, S]
        scores = scores.masked_fill(_causal_mask(total, hi - lo, q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = (probs @ v.transpose(0, 1).float()).transpose(0, 1).to(q.dtype)
    return out


def absorb_weights(w_kv_b: torch.Tensor, heads: int, v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_uk `[H, nope, L]`, w_uv `[H, v, L]`) halves of kv_b_proj's weight."""
    w = w_kv_b.view(heads, -1, w_kv_b.shape[1])
    return w[:, : w.shape[1] - v_head_dim], w[:, w.shape[1] - v_head_dim :]


def mla_attention_absorbed_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
) -> torch.Tensor:
    """Absorbed form; same arguments and result as `mla_attention_ref` (up to rounding)."""
    heads = q.shape[1]
    w_uk, w_uv = absorb_weights(w_kv_b.float(), heads, v_head_dim)
    nope = w_uk.shape[1]
    q_nope, q_pe = q.float().split([nope, q.shape[-1] - nope], dim=-1)
    # q_nope . (W_uk c) = (W_uk^T q_nope) . c
    q_latent = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_pe], dim=-1)  # [T, H, L + R]
    out = q.new_empty(q.shape[0], heads, v_head_dim)
    for i, lo, hi, total in _requests(cu_seqlens_q, seq_lens):
        latent = _gather(cache, page_table[i], total).float()  # [S, L + R]
        scores = q_latent[lo:hi] @ latent.t() * scale  # [Tq, H, S]
        mask = _causal_mask(total, hi - lo, q.device).unsqueeze(1)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        o_latent = probs @ latent[:, : w_uk.shape[2]]  # [Tq, H, L]
        out[lo:hi] = torch.einsum("thl,hvl->thv", o_latent, w_uv).to(q.dtype)
    return out


def mla_decode_absorbed(
    q: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
) -> torch.Tensor:
    """Absorbed form for one query token per request (q `[N, H, nope + R]`), batched over the
    padded page table: no host syncs and shapes fixed by the batch, so CUDA graphs capture it."""
    n, heads = q.shape[0], q.shape[1]
    w_uk, w_uv = absorb_weights(w_kv_b.float(), heads, v_head_dim)
    nope, latent_dim = w_uk.shape[1], w_uk.shape[2]
    q_nope, q_pe = q.float().split([nope, q.shape[-1] - nope], dim=-1)
    q_latent = torch.cat([torch.einsum("nhd,hdl->nhl", q_nope, w_uk), q_pe], dim=-1)  # [N, H, L + R]
    latent = cache[page_table.long()].reshape(n, -1, cache.shape[-1]).float()  # [N, S, L + R]
    scores = torch.einsum("nhc,nsc->nhs", q_latent, latent) * scale
    # padding rows (seq_len 0) attend to one position, so that they stay finite
    pos = torch.arange(latent.shape[1], device=q.device)
    mask = pos.unsqueeze(0) >= seq_lens.clamp_min(1).unsqueeze(1)
    probs = torch.softmax(scores.masked_fill(mask.unsqueeze(1), float("-inf")), dim=-1)
    o_latent = torch.einsum("nhs,nsl->nhl", probs, latent[..., :latent_dim])
    return torch.einsum("nhl,hvl->nhv", o_latent, w_uv).to(q.dtype)
