"""Full-attention layers' backend: writes new K/V into pages, attends over the page table."""

from __future__ import annotations

import torch

from deltaserve.engine.forward_batch import ForwardBatch
from deltaserve.engine.kv_pool import KVPool
from deltaserve.kernels import paged_attention, store_kv
from deltaserve.kernels.mla import mla_attention, store_latent


class AttentionBackend:
    def __init__(self, pool: KVPool, layer_index: dict[int, int]) -> None:
        self.pool = pool
        self.layer_index = layer_index  # model layer id -> pool layer
        self.batch: ForwardBatch | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        self.batch = batch

    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        b = self.batch
        assert b is not None, "prepare() was not called for this forward"
        cache = self.pool.layer(self.layer_index[layer_id])
        store_kv(cache["k"], cache["v"], k, v, b.slot_mapping)
        return paged_attention(
            q, cache["k"], cache["v"], b.page_table, b.cu_seqlens_q, b.seq_lens, scale, b.max_seqlen_q
        )

    def mla_attention(
        self,
        layer_id: int,
        q: torch.Tensor,
        latent: torch.Tensor,
        w_kv_b: torch.Tensor,
        v_head_dim: int,
        scale: float,
    ) -> torch.Tensor:
        """MLA: caches each new token's latent `[T, L + R]` (pool entry "latent"), attends over
        the cached latents with queries `[T, H, nope + R]`; returns `[T, H, v_head_dim]`."""
        b = self.batch
        assert b is not None, "prepare() was not called for this forward"
        cache = self.pool.layer(self.layer_index[layer_id])["latent"]
        store_latent(cache, latent, b.slot_mapping)
        return mla_attention(q, cache, w_kv_b, b.page_table, b.cu_seqlens_q, b.seq_lens, scale, v_head_dim)
