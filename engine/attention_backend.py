"""Full-attention layers' backend: writes new K/V into pages, attends over the page table."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.engine.forward_batch import ForwardBatch
from deltaserve.engine.kv_pool import KVPool
from deltaserve.kernels import paged_attention, store_kv
from deltaserve.kernels.mla import mla_attention, store_latent


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat KV position of each new token
    page_table: torch.Tensor  # [N, max_pages]
    cu_seqlens_q: torch.Tensor  # [N+1]
    seq_lens: torch.Tensor  # [N]
    max_seqlen_q: int


class AttentionBackend:
    def __init__(self, pool: KVPool, layer_index: dict[int, int]) -> None:
        self.pool = pool
        self.layer_index = layer_index  # model layer id -> pool layer
        self.batch: AttentionMetadata | None = None
        self._graph: AttentionMetadata | None = None
        self._verify: AttentionMetadata | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        self.batch = AttentionMetadata(
            batch.slot_mapping, batch.page_table, batch.cu_seqlens_q, batch.seq_lens, batch.max_seqlen_q
        )

    # -- CUDA graphs: decode batches replay through buffers this backend owns ----------

    def init_capture_graph(self, max_bs: int, max_pages: int, device: torch.device) -> None:
        self._graph = AttentionMetadata(
            slot_mapping=torch.zeros(max_bs, dtype=torch.long, device=device),
            page_table=torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device),
            max_seqlen_q=1,
        )

    def prepare_for_capture(self, bs: int) -> None:
        g = self._graph
        assert g is not None, "init_capture_graph() first"
        self.batch = AttentionMetadata(
            g.slot_mapping[:bs], g.page_table[:bs], g.cu_seqlens_q[: bs + 1], g.seq_lens[:bs], 1
        )

    def prepare_for_replay(self, batch: ForwardBatch, bs: int) -> None:
        """Copy a decode batch of n <= bs requests in; rows n..bs pad to page 0 and length 1."""
        g = self._graph
        assert g is not None, "init_capture_graph() first"
        n, width = batch.page_table.shape
        g.slot_mapping[:n].copy_(batch.slot_mapping)
        g.slot_mapping[n:bs].zero_()
        g.page_table[:n, :width].copy_(batch.page_table)
        g.page_table[n:bs].zero_()
        g.seq_lens[:n].copy_(batch.seq_lens)
        g.seq_lens[n:bs].fill_(1)

    def reset_capture(self) -> None:
        self._graph = None

    # verification windows: n requests of `width` tokens each, continuing their KV
    def init_verify_graph(self, max_bs: int, width: int, max_pages: int, device: torch.device) -> None:
        self._verify = AttentionMetadata(
            slot_mapping=torch.zeros(max_bs * width, dtype=torch.long, device=device),
            page_table=torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(0, (max_bs + 1) * width, width, dtype=torch.int32, device=device),
            seq_lens=torch.full((max_bs,), width, dtype=torch.int32, device=device),
            max_seqlen_q=width,
        )

    def prepare_for_verify_capture(self, bs: int) -> None:
        v = self._verify
        assert v is not None, "init_verify_graph() first"
        w = v.max_seqlen_q
        self.batch = AttentionMetadata(
            v.slot_mapping[: bs * w], v.page_table[:bs], v.cu_seqlens_q[: bs + 1], v.seq_lens[:bs], w
        )

    def prepare_for_verify_replay(self, batch: ForwardBatch, bs: int) -> None:
        """n <= bs windows; padding rows write and read the padding page only."""
        v = self._verify
        assert v is not None, "init_verify_graph() first"
        w = v.max_seqlen_q
        n, pages = batch.page_table.shape
        v.slot_mapping[: n * w].copy_(batch.slot_mapping)
        v.slot_mapping[n * w : bs * w].zero_()
        v.page_table[:n, :pages].copy_(batch.page_table)
        v.page_table[n:bs].zero_()
        v.seq_lens[:n].copy_(batch.seq_lens)
        v.seq_lens[n:bs].fill_(w)

    def reset_verify_capture(self) -> None:
        self._verify = None

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
