"""MLA's fast paths: prefill through torch's fused attention over the expanded latents, and decode
as one Triton kernel over the latent cache (`mla/triton.py`) in the absorbed form."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.mla.reference import (
    RequestBounds,
    _causal_mask,
    _expanded_kv,
    _gather,
    _requests,
    absorb_weights,
)


def mla_prefill_sdpa(
    q: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
    num_decodes: int = 0,
    requests: list[RequestBounds] | None = None,
) -> torch.Tensor:
    """Expanded form through torch's fused attention: per request, the cached latents become
    per-head K and V in q's dtype and `scaled_dot_product_attention` attends without the
    `[H, Tq, S]` fp32 scores the reference materialises (on CUDA its flash / memory-efficient
    kernels). V is zero-padded to the key width, so that one head size serves both.

    The first `num_decodes` requests (one query row each, rows `0:num_decodes`) take the decode
    kernel in one launch: a mixed step's hundreds of decode rows would otherwise each pay a loop
    turn of launches and expand their whole context. `requests`: (request, first row, end row, KV
    length) of the others, from the host; None reads them back from the device."""
    heads, width = q.shape[1], q.shape[2]
    w = w_kv_b.to(q.dtype)
    out = q.new_empty(q.shape[0], heads, v_head_dim)
    if num_decodes:
        d = slice(0, num_decodes)
        out[d] = mla_decode_triton(q[d], cache, w_kv_b, page_table[d], seq_lens[d], scale, v_head_dim)
    if requests is None:
        requests = _requests(cu_seqlens_q, seq_lens, num_decodes)
    for i, lo, hi, total in requests:
        k, v = _expanded_kv(_gather(cache, page_table[i], total).to(q.dtype), w, heads, v_head_dim)
        if v_head_dim < width:
            v = F.pad(v, (0, width - v_head_dim))
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (q[lo:hi], k, v))  # [1, H, len, D]
        if hi - lo == total:  # no cached prefix: plain causal
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:
            allowed = ~_causal_mask(total, hi - lo, q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=scale)
        out[lo:hi] = o[0, :, :, :v_head_dim].transpose(0, 1)
    return out


def _num_splits(programs: int, max_positions: int, device: torch.device) -> int:
    """Splits of the positions per (request, head block): about two programs per
    multiprocessor in all, each with at least 256 positions, at most 32. Shapes only, so a
    captured graph keeps its launch."""
    from deltaserve.kernels.common.launch import sm_count

    want = max(1, (2 * sm_count(device)) // max(programs, 1))
    return max(1, min(want, max_positions // 256, 32))


def mla_decode_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
) -> torch.Tensor:
    """`mla_decode_absorbed` with the attention over the latent cache in one Triton kernel."""
    import triton

    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.mla.triton import _mla_decode_kernel

    n, heads = q.shape[0], q.shape[1]
    w_uk, w_uv = absorb_weights(w_kv_b.float(), heads, v_head_dim)
    nope, latent_dim = w_uk.shape[1], w_uk.shape[2]
    rope = cache.shape[-1] - latent_dim
    q_nope, q_pe = q.float().split([nope, q.shape[-1] - nope], dim=-1)
    q_latent = torch.cat([torch.einsum("nhd,hdl->nhl", q_nope, w_uk), q_pe], dim=-1).contiguous()
    block_h = 16  # tl.dot needs 16 rows; heads past H are masked
    head_blocks = triton.cdiv(heads, block_h)
    splits = _num_splits(n * head_blocks, page_table.shape[1] * cache.shape[1], q.device)
    partial = torch.empty(n, heads, splits, latent_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(n, heads, splits, 2, dtype=torch.float32, device=q.device)
    _mla_decode_kernel[(n, head_blocks, splits)](
        q_latent, cache, page_table, seq_lens, partial, ml, scale, heads,
        q_latent.stride(0), q_latent.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), SPLITS=splits,
        L=latent_dim, R=rope, PAGE=cache.shape[1], BH=block_h,
        BL=max(16, triton.next_power_of_2(latent_dim)), BR=max(16, triton.next_power_of_2(rope)), BN=16,
        PRECISION="ieee" if cache.dtype == torch.float32 else "tf32",
        # fp32 tiles of 512-wide latents: one stage keeps shared memory well inside Hopper's
        num_warps=4, num_stages=1,
        **pdl_args(q_latent.device),
    )  # fmt: skip
    # log-sum-exp merge of the splits
    m, den = ml[..., 0], ml[..., 1]
    weight = torch.exp(m - m.amax(dim=-1, keepdim=True))  # [N, H, S]; empty splits get 0
    o_latent = (weight.unsqueeze(-1) * partial).sum(2) / (weight * den).sum(-1, keepdim=True)
    return torch.einsum("nhl,hvl->nhv", o_latent, w_uv).to(q.dtype)
