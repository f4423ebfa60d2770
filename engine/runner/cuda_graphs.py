"""Decode by CUDA-graph replay: one graph per padded batch size, sharing one memory pool.

Everything a graph reads lives in buffers filled before replay: the token ids and
positions here, the page table and lengths in the attention backend, the state-slot
indices in the linear-attention backend. Rows past the real batch point at the padding
page and the padding slot.

Graphs come in sets by tokens per request: 1 for decode batches, and k + 1 for batches made
only of speculative verification windows (`capture_verify`); the backends keep one set of
buffers per width.
"""

from __future__ import annotations

import bisect
import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from deltaserve.engine.runner.attention_backend import AttentionBackend
from deltaserve.engine.runner.forward_batch import ForwardBatch
from deltaserve.engine.runner.linear_backend import LinearAttentionBackend
from deltaserve.kernels.common.launch import capturing_graph

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (and max_bs itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


@contextmanager
def on_side_stream() -> Iterator[None]:
    """Run on a fresh stream that waits for the current one, and that the current one waits for
    after: warm-ups and captures stay off the default stream, which a capture may not use."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's garbage collector paused for a capture. A collection there can free another CUDA
    graph (one of an engine dropped earlier, kept alive by a reference cycle), and destroying a
    graph while a stream captures is an error that invalidates this capture, and a failed capture
    leaves CUDA's random generator unusable for the rest of the process. (No collection first: a
    full one per captured graph costs start-up time.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture(
    fn: Callable[[], torch.Tensor], pool: Any, warmups: int = 1
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `fn` `warmups` times on a side stream (Triton compiles, autotuning and lazy
    workspaces stay outside the capture), then capture it: the graph and its static output."""
    with on_side_stream():
        for _ in range(warmups):
            fn()
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


@dataclass
class GraphSet:
    """The graphs of one width (tokens per request), per padded batch size."""

    width: int
    sizes: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(default_factory=dict)
    replays: int = 0


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
        self.body = body  # (input_ids, positions) -> logits of every token
        self.attn = attn
        self.linear = linear
        self.max_pages = max_pages
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.decode = self._capture_set(1, max_bs)
        self.verify: GraphSet | None = None

    @property
    def sizes(self) -> list[int]:
        return self.decode.sizes

    @property
    def graphs(self) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
        return self.decode.graphs

    def _capture_set(self, width: int, max_bs: int) -> GraphSet:
        sizes = graph_batch_sizes(max_bs)
        top = sizes[-1]
        gs = GraphSet(
            width,
            sizes,
            torch.zeros(top * width, dtype=torch.long, device=self.device),
            torch.zeros(top * width, dtype=torch.long, device=self.device),
        )
        self.attn.init_capture_graph(top, self.max_pages, self.device, width)
        self.linear.init_capture_graph(top, self.device, width)
        # largest first, so that smaller graphs reuse its memory
        for bs in reversed(sizes):
            self.attn.prepare_for_capture(bs, width)
            self.linear.prepare_for_capture(bs, width)
            gs.graphs[bs] = self._capture(gs.input_ids[: bs * width], gs.positions[: bs * width])
        torch.cuda.synchronize()
        return gs

    def _capture(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # small graphs launch our kernels with PDL (DELTASERVE_PDL, kernels/common/launch.py)
        with capturing_graph(input_ids.numel()):
            return capture(lambda: self.body(input_ids, positions), self.pool, warmups=2)

    def capture_verify(self, width: int, max_bs: int) -> None:
        """Graphs for batches of speculative verification windows only, each `width` tokens
        (the last token and k drafts), per padded batch size up to `max_bs`. On failure the
        backends' buffers of that width are dropped and the error is raised."""
        try:
            self.verify = self._capture_set(width, max_bs)
        except Exception:
            self.attn.reset_capture(width)
            self.linear.reset_capture(width)
            raise

    def drop_verify(self) -> None:
        if self.verify is not None:
            self.attn.reset_capture(self.verify.width)
            self.linear.reset_capture(self.verify.width)
        self.verify = None

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.takes_decode(batch.num_requests, batch.num_decodes)

    def takes_decode(self, num_requests: int, num_decodes: int) -> bool:
        """A batch of these counts replays a decode graph."""
        return num_decodes == num_requests and num_requests <= self.decode.sizes[-1]

    def can_run_verify(self, batch: ForwardBatch) -> bool:
        v, n = self.verify, batch.num_requests
        return (
            v is not None
            and batch.num_decodes == 0
            and len(batch.verify_lens) == n
            and n <= v.sizes[-1]
            and all(w == v.width for w in batch.verify_lens)
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[n, vocab]` of a decode batch."""
        return self._replay(self.decode, batch)

    def run_verify(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of every window position `[n * width, vocab]`."""
        assert self.verify is not None
        return self._replay(self.verify, batch)

    def _replay(self, gs: GraphSet, batch: ForwardBatch) -> torch.Tensor:
        n, w = batch.num_requests, gs.width
        bs = gs.sizes[bisect.bisect_left(gs.sizes, n)]
        gs.input_ids[: n * w].copy_(batch.input_ids)
        gs.positions[: n * w].copy_(batch.positions)
        self.linear.prepare_for_replay(batch, bs, w)
        self.attn.prepare_for_replay(batch, bs, w, self.linear.graph_slots(w)[:bs])
        graph, out = gs.graphs[bs]
        graph.replay()
        gs.replays += 1
        return out[: n * w]

    def close(self) -> None:
        self.drop_verify()
        self.decode.graphs.clear()
        self.attn.reset_capture(1)
        self.linear.reset_capture(1)
