"""Decode by CUDA-graph replay: one graph per padded batch size, sharing one memory pool.

Everything a graph reads lives in buffers filled before replay: the token ids and
positions here, the page table and lengths in the attention backend, the state-slot
indices in the linear-attention backend. Rows past the real batch point at the padding
page and the padding slot.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from deltaserve.engine.attention_backend import AttentionBackend
from deltaserve.engine.forward_batch import ForwardBatch
from deltaserve.engine.linear_backend import LinearAttentionBackend

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (and max_bs itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


class CudaGraphRunner:
    def __init__(
        self,
        body: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        attn: AttentionBackend,
        linear: LinearAttentionBackend,
        max_bs: int,
        max_pages: int,
        device: torch.device,
    ) -> None:
        self.body = body  # (input_ids, positions) -> logits, the model's forward on a decode batch
        self.attn = attn
        self.linear = linear
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        attn.init_capture_graph(self.max_bs, max_pages, device)
        linear.init_capture_graph(self.max_bs, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # largest first, so that smaller graphs reuse its memory
        for bs in reversed(self.sizes):
            self.attn.prepare_for_capture(bs)
            self.linear.prepare_for_capture(bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile and autotune outside the capture
                    self.body(self.input_ids[:bs], self.positions[:bs])
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.body(self.input_ids[:bs], self.positions[:bs])
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.num_decodes == batch.num_requests and batch.num_requests <= self.max_bs

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_requests
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.attn.prepare_for_replay(batch, bs)
        self.linear.prepare_for_replay(batch, bs)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]

    def close(self) -> None:
        self.graphs.clear()
        self.attn.reset_capture()
        self.linear.reset_capture()
