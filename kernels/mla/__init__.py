"""Multi-head latent attention (MLA) over a paged cache of compressed latents.

The cache holds, per token, the normalised KV latent c (kv_lora_rank) followed by the shared
rope-part key k_pe (qk_rope_head_dim): `[P, page_size, L + R]` per layer, paged like
`deltaserve.kernels.attention`. Keys and values are never cached per head: `kv_b_proj`
(`w_kv_b [H * (nope + v), L]`) expands c into each head's k_nope and v.

Two formulations of the same attention:
- expanded: expand every cached latent into per-head K and V, then attend. Same order of
  operations as transformers, so it is the CPU oracle.
- absorbed: fold w_kv_b's key half into the query and its value half into the output, and
  attend over the latents directly (L + R wide, one shared "head"): far less work and memory
  traffic per decoded token, the form decode kernels use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from deltaserve.kernels.dispatch import use_fast_path


def store_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new latents `[T, L + R]` to flat cache positions `slot_mapping [T]`."""
    cache.view(-1, cache.shape[-1])[slot_mapping.long()] = latent.to(cache.dtype)


def _gather(cache: torch.Tensor, pages: torch.Tensor, total: int) -> torch.Tensor:
    page_size = cache.shape[1]
    pos = torch.arange(total, device=cache.device)
    return cache[pages[pos // page_size].long(), pos % page_size]  # [S, L + R]


def _causal_mask(total: int, q_len: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(total, device=device)
    q_pos = torch.arange(total - q_len, total, device=device)
    return pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [Tq, S], True where masked


def _requests(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> Iterator[tuple[int, int, int, int]]:
    """(request, first query row, end query row, KV length) of each request with queries."""
    bounds = cu_seqlens_q.tolist()
    for i, total in enumerate(seq_lens.tolist()):
        if bounds[i + 1] > bounds[i]:
            yield i, bounds[i], bounds[i + 1], total


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


def mla_prefill_sdpa(
    q: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
) -> torch.Tensor:
    """Expanded form through torch's fused attention: per request, the cached latents become
    per-head K and V in q's dtype and `scaled_dot_product_attention` attends without the
    `[H, Tq, S]` fp32 scores the reference materialises (on CUDA its flash / memory-efficient
    kernels). V is zero-padded to the key width, so that one head size serves both."""
    heads, width = q.shape[1], q.shape[2]
    w = w_kv_b.to(q.dtype)
    out = q.new_empty(q.shape[0], heads, v_head_dim)
    for i, lo, hi, total in _requests(cu_seqlens_q, seq_lens):
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


def mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
) -> torch.Tensor:
    """q `[T, H, nope + R]` packed over N requests; returns `[T, H, v_head_dim]`.

    CPU runs the expanded reference. On CUDA, batches of one token per request (decode, and
    what CUDA graphs capture) take the Triton kernel over the latent cache (absorbed form);
    prefill takes the same expansion through torch's fused attention (`mla_prefill_sdpa`, which
    never materialises the fp32 scores), or with `DELTASERVE_MLA_PREFILL=reference` the
    expanded reference.
    """
    if use_fast_path(q):
        if q.shape[0] == seq_lens.shape[0]:
            return mla_decode_triton(q, cache, w_kv_b, page_table, seq_lens, scale, v_head_dim)
        if mla_prefill_mode() == "sdpa":
            return mla_prefill_sdpa(q, cache, w_kv_b, page_table, cu_seqlens_q, seq_lens, scale, v_head_dim)
    return mla_attention_ref(q, cache, w_kv_b, page_table, cu_seqlens_q, seq_lens, scale, v_head_dim)


MLA_PREFILL_MODES = ("sdpa", "reference")


def mla_prefill_mode() -> str:
    """`DELTASERVE_MLA_PREFILL`: `sdpa` (the default) or `reference`."""
    mode = os.environ.get("DELTASERVE_MLA_PREFILL", "sdpa") or "sdpa"
    if mode not in MLA_PREFILL_MODES:
        raise ValueError(
            f"DELTASERVE_MLA_PREFILL must be one of {', '.join(MLA_PREFILL_MODES)}, got {mode!r}"
        )
    return mode


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
