"""Sampling by CUDA-graph replay, for small batches.

Sampling a batch eagerly launches about twenty small kernels from Python (scaling, ranking,
three softmaxes, the masks, the race, the greedy rows' argmax); at small batches those
launches, host time rather than the GPU's, are most of what sampling adds to a decode step.
Here the same ops (`pick_tokens`, shared with the eager path) are
captured once per padded batch size and ranking width, reading static buffers: the logits,
the per-row parameters and the noise. A step then costs a copy of the logits, the logit
processing it needs (biases, penalties, min_tokens bans and grammar masks run eagerly on the
static logits, in place), one copy of the parameters, the noise and a replay.

The ranking width is part of the graph: none (no row sets top-k or top-p), the best
`bucket` tokens (every row's top-k at most `bucket`, one of TOPK_BUCKETS) or a full sort;
and so is whether a ranked batch holds a seeded row, whose noise is then read by token id.
Graphs are captured lazily, on a batch's first use of its key; the capture waits
for the device once.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deltaserve.engine.requests.request import Request
from deltaserve.engine.runner.cuda_graphs import capture, graph_batch_sizes
from deltaserve.engine.runner.h2d import copy_to_device
from deltaserve.engine.sampling.ops import TOPK_LIMIT, param_rows, pick_tokens, ranking_width, seeded

logger = logging.getLogger(__name__)

# top-k widths graphs are captured for (a batch ranks the smallest that holds its largest k);
# larger k, or a row without one, sorts the whole vocabulary
TOPK_BUCKETS = (64, 256, TOPK_LIMIT)
# batches of fewer rows sort instead of ranking with `torch.topk`. Inside a graph only the GPU's
# time counts, so every batch may rank (`bench/engine/sampler.py --graphs 32 --graph-topk-min-rows N`
# compares the two)
GRAPH_TOPK_MIN_ROWS = 1

# captures `fn` (static inputs to a static output): the replay callable and the output
Capture = Callable[[Callable[[], torch.Tensor], Any], tuple[Callable[[], None], torch.Tensor]]
# the sampler's logit processing of `reqs` into the given buffer (`Sampler.process`)
Process = Callable[[torch.Tensor, list[Request], torch.Tensor], torch.Tensor]
# the sampler's Exp(1) noise for `reqs` over a vocabulary (`Sampler.fill_noise`)
FillNoise = Callable[[torch.Tensor, list[Request], int], None]


def cuda_capture(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    """Captures `fn` in a CUDA graph drawing on the memory pool `pool` (shared by the sampler's
    graphs: they replay one at a time, and each keeps only its output)."""
    graph, out = capture(fn, pool)
    return graph.replay, out


class SamplerGraphs:
    """Replays `pick_tokens` for batches of at most `max_bs` rows."""

    def __init__(
        self,
        process: Process,
        fill_noise: FillNoise,
        device: torch.device,
        vocab: int,
        max_bs: int,
        capture: Capture | None = None,
    ) -> None:
        self.process = process
        self.fill_noise = fill_noise
        self.vocab = vocab
        self.sizes = graph_batch_sizes(max_bs)
        self.capture = capture or cuda_capture
        top, dev = self.sizes[-1], device
        with torch.inference_mode():
            self.logits = torch.zeros(top, vocab, dtype=torch.float32, device=dev)
            self.noise = torch.ones(top, vocab, dtype=torch.float32, device=dev)
            # temperature, min_p, top_p, top_k, greedy per row (padding rows: plain sampling)
            self._pad = np.array([1.0, 0.0, 1.0, vocab, 0.0], dtype=np.float32)
            self.params = torch.tensor(np.repeat(self._pad[None], top, 0), device=dev)
        self.pool = torch.cuda.graph_pool_handle() if capture is None and dev.type == "cuda" else None
        self.graphs: dict[tuple[int, int, bool], tuple[Callable[[], None], torch.Tensor]] = {}
        self.replays = 0
        self.failed = False

    def takes(self, n: int, vocab: int) -> bool:
        return not self.failed and 0 < n <= self.sizes[-1] and vocab == self.vocab

    def width(self, reqs: list[Request]) -> int:
        """The eager sampler's ranking width (`ranking_width`) with a top-k rounded up to its
        bucket: 0 (no ranking), a bucket, or the vocabulary (a full sort)."""
        width = ranking_width(reqs, self.vocab, GRAPH_TOPK_MIN_ROWS)
        if 0 < width < self.vocab:
            bucket = TOPK_BUCKETS[bisect.bisect_left(TOPK_BUCKETS, width)]  # the last is TOPK_LIMIT
            return bucket if bucket < self.vocab else self.vocab
        return width

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor | None:
        """The tokens of `reqs` `[n]` from their logits `[n, vocab]` (fp32), left on the device:
        a view of the graph's output, valid until that graph is replayed again. None if the
        capture failed (the sampler then samples eagerly, now and from then on)."""
        n = len(reqs)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = self.width(reqs)
        self.process(logits, reqs, self.logits[:n])
        rows = np.empty((bs, 5), dtype=np.float32)
        rows[:n] = np.array(param_rows(reqs, self.vocab), dtype=np.float32).T
        rows[n:] = self._pad
        copy_to_device(self.params[:bs], rows)
        by_token = seeded(reqs, width)
        key = (bs, width, by_token)
        if key not in self.graphs:
            try:
                self.graphs[key] = self.capture(self._body(bs, width, by_token), self.pool)
            except Exception as e:  # an op that cannot be captured
                logger.warning("sampler graph capture failed (%s); sampling eagerly", e)
                self.failed = True
                return None
            logger.info("captured a sampler graph for %d rows, ranking width %d", bs, width)
        # drawn once the graph exists: after a failed capture the eager sampler draws seeded rows' noise
        self.fill_noise(self.noise[:n, : self._columns(width, by_token)], reqs, self.vocab)
        replay, out = self.graphs[key]
        replay()
        self.replays += 1
        return out[:n]

    def _columns(self, width: int, by_token: bool) -> int:
        return self.vocab if by_token else width or self.vocab

    def _body(self, bs: int, width: int, by_token: bool) -> Callable[[], torch.Tensor]:
        logits, noise = self.logits[:bs], self.noise[:bs, : self._columns(width, by_token)]
        temp, min_p, top_p, top_k, greedy = self.params[:bs].unbind(1)

        def body() -> torch.Tensor:
            return pick_tokens(logits, temp, min_p, top_p, top_k.long(), greedy > 0, noise, width, by_token)

        return body
