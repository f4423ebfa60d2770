"""Causal attention over the paged KV cache, for prefill chunks (with a cached prefix) and decode.

Caches are `[P, page_size, Hkv, D]` per layer. A request's KV position p lives in page
`page_table[i, p // page_size]` at offset `p % page_size`. Query token j of request i
(of `q_len` new tokens) sits at position `seq_lens[i] - q_len + j` and sees positions up to
and including its own.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.attention.reference import paged_attention_ref
from deltaserve.kernels.dispatch import use_fast_path


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys and values `[T, Hkv, D]` to flat cache positions `slot_mapping [T]`
    (one kernel on CUDA; torch runs an indexed copy each)."""
    if use_fast_path(k):
        from deltaserve.kernels.attention.triton import store_kv_launch

        return store_kv_launch(k_cache, v_cache, k, v, slot_mapping)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    idx = slot_mapping.long()
    flat_k[idx] = k.to(k_cache.dtype)
    flat_v[idx] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """q `[T, Hq, D]` packed over N requests; returns `[T, Hq, D]`.

    `max_seqlen_q == 1` tells the fast path every request is decoding one token.
    """
    if use_fast_path(q):
        from deltaserve.kernels.attention.cuda import paged_attention_cuda

        return paged_attention_cuda(
            q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, max_seqlen_q
        )
    return paged_attention_ref(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale)
