"""Full-attention layers' backend: writes new K/V into pages, attends over the page table."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Any

import torch

from deltaserve.engine.cache.kv_pool import KVPool
from deltaserve.engine.cache.page_table import SlotPageTable
from deltaserve.engine.runner.forward_batch import ForwardBatch
from deltaserve.kernels.attention import paged_attention, store_kv
from deltaserve.kernels.mla import mla_attention, store_latent
from deltaserve.kernels.mla.reference import RequestBounds, request_bounds
from deltaserve.models.forward import AttentionOps


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat KV position of each new token
    page_table: torch.Tensor  # [N, max_pages]
    cu_seqlens_q: torch.Tensor  # [N+1]
    seq_lens: torch.Tensor  # [N]
    max_seqlen_q: int
    num_decodes: int = 0  # the first requests, one query row each
    source: dict[str, Any] | None = None  # the host lists the batch was built from

    @cached_property
    def requests(self) -> list[RequestBounds] | None:
        """The bounds of the requests past the decode rows, from the host's lists (MLA's prefill
        loop; built at its first layer's call, so models without MLA never build them)."""
        if self.source is None:
            return None
        tokens, starts = self.source["token_lists"], self.source["starts"]
        if len(tokens) == self.num_decodes:  # decode rows only: the decode kernel's
            return []
        bounds = [0, *accumulate(len(t) for t in tokens)]
        return request_bounds(bounds, [s + len(t) for s, t in zip(starts, tokens)], self.num_decodes)


class AttentionBackend(AttentionOps):
    """`models.forward.AttentionOps` over the KV pool: `prepare` (or a graph's buffers) sets
    the batch, then each full-attention layer's call stores its K / V and attends."""

    def __init__(self, pool: KVPool, layer_index: dict[int, int]) -> None:
        self.pool = pool
        self.layer_index = layer_index  # model layer id -> pool layer
        self.batch: AttentionMetadata | None = None
        # CUDA-graph buffers per width (tokens per request: 1 decode, k + 1 verification)
        self._graphs: dict[int, AttentionMetadata] = {}
        # decode batches: each state slot's pages kept on the device (set by the model runner)
        self.slot_pages: SlotPageTable | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        page_table = batch.page_table
        if page_table is None:  # a decode batch: its slots' rows, as wide as its longest
            assert self.slot_pages is not None, "a batch without a page table needs the slot table"
            page_table = self.slot_pages.table[:, : batch.page_columns].index_select(0, batch.state_slots)
        self.batch = AttentionMetadata(
            batch.slot_mapping,
            page_table,
            batch.cu_seqlens_q,
            batch.seq_lens,
            batch.max_seqlen_q,
            batch.num_decodes,
            batch.source,
        )

    # -- CUDA graphs: batches of n requests of `width` tokens each (decode: 1; speculative
    # verification windows: k + 1) replay through buffers this backend owns ------------

    def init_capture_graph(self, max_bs: int, max_pages: int, device: torch.device, width: int = 1) -> None:
        self._graphs[width] = AttentionMetadata(
            slot_mapping=torch.zeros(max_bs * width, dtype=torch.long, device=device),
            page_table=torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(0, (max_bs + 1) * width, width, dtype=torch.int32, device=device),
            seq_lens=torch.full((max_bs,), width, dtype=torch.int32, device=device),
            max_seqlen_q=width,
        )

    def prepare_for_capture(self, bs: int, width: int = 1) -> None:
        g = self._graphs[width]
        self.batch = AttentionMetadata(
            g.slot_mapping[: bs * width], g.page_table[:bs], g.cu_seqlens_q[: bs + 1], g.seq_lens[:bs], width
        )

    def prepare_for_replay(
        self, batch: ForwardBatch, bs: int, width: int = 1, slots: torch.Tensor | None = None
    ) -> None:
        """Copy a batch of n <= bs requests in; rows n..bs use the padding page (page 0) and a
        length of `width`. A batch without a page table takes its rows from `slot_pages` by
        `slots` (`[bs]`, the padding rows at slot 0, whose row is the padding page)."""
        g = self._graphs[width]
        n = batch.num_requests
        g.slot_mapping[: n * width].copy_(batch.slot_mapping)
        g.slot_mapping[n * width : bs * width].zero_()
        if batch.page_table is None:
            assert self.slot_pages is not None and slots is not None and slots.shape[0] == bs
            self.slot_pages.gather(slots, g.page_table[:bs])
        else:
            pages = batch.page_table.shape[1]
            g.page_table[:n, :pages].copy_(batch.page_table)
            g.page_table[n:bs].zero_()
        g.seq_lens[:n].copy_(batch.seq_lens)
        g.seq_lens[n:bs].fill_(width)

    def reset_capture(self, width: int = 1) -> None:
        self._graphs.pop(width, None)

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
        return mla_attention(
            q,
            cache,
            w_kv_b,
            b.page_table,
            b.cu_seqlens_q,
            b.seq_lens,
            scale,
            v_head_dim,
            b.num_decodes,
            b.requests,
        )
