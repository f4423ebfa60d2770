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
        self.pool = torch.cuda.graph_pool_handle()
        # largest first, so that smaller graphs reuse its memory
        for bs in reversed(self.sizes):
            self.attn.prepare_for_capture(bs)
            self.linear.prepare_for_capture(bs)
            self.graphs[bs] = self._capture(self.input_ids[:bs], self.positions[:bs])
        torch.cuda.synchronize()
        # speculative verification: every request brings `verify_width` tokens (capture_verify)
        self.verify_width = 0
        self.verify_sizes: list[int] = []
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_replays = 0

    def _capture(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and autotune outside the capture
                self.body(input_ids, positions)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.body(input_ids, positions)
        return graph, out

    def capture_verify(self, width: int, max_bs: int, max_pages: int, device: torch.device) -> None:
        """Graphs for batches of speculative verification windows only, each `width` tokens
        (the last token and k drafts), per padded batch size up to `max_bs`."""
        sizes = graph_batch_sizes(max_bs)
        top = sizes[-1]
        input_ids = torch.zeros(top * width, dtype=torch.long, device=device)
        positions = torch.zeros(top * width, dtype=torch.long, device=device)
        self.attn.init_verify_graph(top, width, max_pages, device)
        self.linear.init_verify_graph(top, width, device)
        graphs = {}
        for bs in reversed(sizes):
            self.attn.prepare_for_verify_capture(bs)
            self.linear.prepare_for_verify_capture(bs)
            graphs[bs] = self._capture(input_ids[: bs * width], positions[: bs * width])
        torch.cuda.synchronize()
        self.verify_input_ids, self.verify_positions = input_ids, positions
        self.verify_width, self.verify_sizes, self.verify_graphs = width, sizes, graphs

    def drop_verify(self) -> None:
        self.verify_width, self.verify_sizes, self.verify_graphs = 0, [], {}
        self.attn.reset_verify_capture()
        self.linear.reset_verify_capture()

    def can_run_verify(self, batch: ForwardBatch) -> bool:
        n = batch.num_requests
        return (
            bool(self.verify_graphs)
            and batch.num_decodes == 0
            and len(batch.verify_lens) == n
            and n <= self.verify_sizes[-1]
            and all(w == self.verify_width for w in batch.verify_lens)
        )

    def run_verify(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of every window position `[n * width, vocab]`."""
        n, w = batch.num_requests, self.verify_width
        bs = self.verify_sizes[bisect.bisect_left(self.verify_sizes, n)]
        self.verify_input_ids[: n * w].copy_(batch.input_ids)
        self.verify_positions[: n * w].copy_(batch.positions)
        self.attn.prepare_for_verify_replay(batch, bs)
        self.linear.prepare_for_verify_replay(batch, bs)
        graph, out = self.verify_graphs[bs]
        graph.replay()
        self.verify_replays += 1
        return out[: n * w]

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
        self.drop_verify()
