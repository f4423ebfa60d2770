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

Both references are in `mla/reference.py`, the fast paths in `mla/cuda.py`.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.common.launch import env_mode
from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.mla.cuda import mla_decode_triton, mla_prefill_sdpa
from deltaserve.kernels.mla.reference import RequestBounds, mla_attention_ref


def store_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new latents `[T, L + R]` to flat cache positions `slot_mapping [T]`."""
    cache.view(-1, cache.shape[-1])[slot_mapping.long()] = latent.to(cache.dtype)


def mla_attention(
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
    """q `[T, H, nope + R]` packed over N requests; returns `[T, H, v_head_dim]`. The first
    `num_decodes` requests have one query row each; `requests`, from the host where known: (request,
    first row, end row, KV length) of the others (the fast path's; the reference reads its own).

    CPU runs the expanded reference. On CUDA, batches of one token per request (decode, and
    what CUDA graphs capture) take the Triton kernel over the latent cache (absorbed form);
    prefill takes the same expansion through torch's fused attention (`mla_prefill_sdpa`, which
    never materialises the fp32 scores; a mixed batch's decode rows take the decode kernel), or
    with `DELTASERVE_MLA_PREFILL=reference` the expanded reference.
    """
    if use_fast_path(q):
        if q.shape[0] == seq_lens.shape[0]:
            return mla_decode_triton(q, cache, w_kv_b, page_table, seq_lens, scale, v_head_dim)
        if mla_prefill_mode() == "sdpa":
            return mla_prefill_sdpa(
                q, cache, w_kv_b, page_table, cu_seqlens_q, seq_lens, scale, v_head_dim, num_decodes, requests
            )
    return mla_attention_ref(q, cache, w_kv_b, page_table, cu_seqlens_q, seq_lens, scale, v_head_dim)


MLA_PREFILL_MODES = ("sdpa", "reference")


def mla_prefill_mode() -> str:
    """`DELTASERVE_MLA_PREFILL`: `sdpa` (the default) or `reference`."""
    return env_mode("DELTASERVE_MLA_PREFILL", MLA_PREFILL_MODES, "sdpa")
