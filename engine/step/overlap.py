"""Overlap scheduling: one step in flight, its sampled tokens read back at the next step.

A step schedules and launches its forward pass before it reads the previous step's sampled
tokens back, so that the host's work (scheduling, batch building, stop checks, outputs) runs
while the GPU computes. A decode whose previous token is still on the device carries a
placeholder (`Request.num_placeholders`) that the batch fills from the device. A request that
stops on a token read back late has already run one more step: that step's token is real (it
is the stop token), so its KV and state are consistent and only its sampled output is dropped.
Steps that need host data before sampling (penalties, min_tokens, logprobs, speculative
decoding), or whose decodes could need a preemption, first finish the step in flight and then
run synchronously (`can_overlap`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.engine.requests.request import Request
from deltaserve.engine.runner.forward_batch import ForwardBatch
from deltaserve.engine.runner.h2d import to_device_packed
from deltaserve.engine.sampling.sampler import Sampler
from deltaserve.engine.step.scheduler import SchedulerOutput
from deltaserve.engine.step.token_sink import TokenSink


@dataclass
class InFlight:
    """A launched step whose sampled tokens have not been read back."""

    sampled: list[Request]
    tokens: torch.Tensor  # on the device, one per sampled request
    host: torch.Tensor  # their copy on the host (pinned on CUDA), valid once `done` fired
    done: Any  # torch.cuda.Event, or None off CUDA


def can_overlap(
    sampler: Sampler,
    requests: Iterable[Request],
    running: list[Request],
    page_size: int,
    free_pages: int,
    in_flight: bool,
) -> bool:
    """No host data needed before sampling, and (with a step in flight, whose tokens are not
    known) pages for every decode without preempting anyone (`free_pages`: free or evictable)."""
    if any(
        r.params.logprobs is not None or r.params.prompt_logprobs is not None or sampler.needs_processing(r)
        for r in requests
    ):
        return False
    if not in_flight:
        return True
    need = sum(max(0, -(-r.num_tokens // page_size) - len(r.pages)) for r in running)
    return need <= free_pages


class Overlap:
    """The step in flight and the host buffers its tokens come back through."""

    def __init__(self, sampler: Sampler, device: torch.device, num_running: int) -> None:
        self.sampler = sampler
        self.device = device
        self.in_flight: InFlight | None = None
        # seconds the host has waited for a step's tokens (benchmarks read it: a step's wall
        # time less this is its host work, the part that overlap has to hide)
        self.read_back_wait_s = 0.0
        self._host_buffers: list[torch.Tensor] = []
        if device.type == "cuda":
            self._host_buffers = [
                torch.empty(num_running, dtype=torch.long, pin_memory=True) for _ in range(2)
            ]

    def hold(self, launched: InFlight | None) -> None:
        """`launched` is the step in flight until the next step reads it back."""
        self.in_flight = launched

    def take(self) -> InFlight | None:
        """The step in flight, which the caller now reads back; none is left in flight."""
        prev, self.in_flight = self.in_flight, None
        return prev

    def fill_placeholders(self, batch: ForwardBatch, plan: SchedulerOutput, prev: InFlight) -> None:
        """Decode rows whose input is the previous step's token: take it from the device."""
        index = {id(r): i for i, r in enumerate(prev.sampled)}
        rows, src = [], []
        for row, c in enumerate(plan.chunks[: plan.num_decodes]):
            if c.req.num_placeholders:
                rows.append(row)
                src.append(index[id(c.req)])
        if not rows:
            return
        batch.inputs_on_device = True
        k = len(rows)
        if rows[-1] == k - 1 and src == rows:  # the steady state: one copy, nothing to send
            batch.input_ids[:k].copy_(prev.tokens[:k])
            return
        rows_t, src_t = to_device_packed([(rows, torch.long), (src, torch.long)], batch.input_ids.device)
        batch.input_ids.index_copy_(0, rows_t, prev.tokens.index_select(0, src_t))

    def launch(self, sampled: list[Request], logits: torch.Tensor) -> InFlight:
        """Sample `sampled`'s tokens on the device and start their copy to the host."""
        tokens = self.sampler.sample_tokens(logits, sampled)
        if not self._host_buffers:  # off CUDA the copy is synchronous (and a copy: `tokens` may
            # be a sampler graph's output, which the next step's sampling overwrites)
            return InFlight(sampled, tokens, tokens.to("cpu", copy=True), None)
        self._host_buffers.reverse()  # the other buffer may still be read for the previous step
        host = self._host_buffers[0][: len(sampled)]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # the copy's stream, on any cuda:N
        return InFlight(sampled, tokens, host, done)

    def read_back(self, prev: InFlight, sink: TokenSink) -> list[tuple[Request, int]]:
        """The step's tokens replace its placeholders (requests aborted meanwhile drop theirs)."""
        if prev.done is not None:
            t = time.perf_counter()
            prev.done.synchronize()
            self.read_back_wait_s += time.perf_counter() - t
        now = time.time()
        read = []
        for req, tok in zip(prev.sampled, prev.host.tolist()):
            if req.finished:
                continue
            req.num_placeholders -= 1
            sink.record(req, tok, None, now)
            read.append((req, tok))
        return read
