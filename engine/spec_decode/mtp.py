"""MTP drafting: after each step, the checkpoint's multi-token-prediction layer proposes the
next step's drafts.

1. Fill: for every request still running, each position p the model computed this step gets
   its MTP entry from the model's hidden state h_p and the now-known token p + 1 (the next
   prompt token, an accepted draft, or the token just sampled). This writes the MTP layer's
   KV at p (its own layer in the KV pool, in the request's pages), so the MTP attends over
   the whole sequence like the model does.
2. Draft: for requests that got a new token, the fill's last output predicts d_1; each of
   the k - 1 chained steps feeds the previous output hidden state and draft token at the
   next position (KV written past the sequence: overwritten by the next step's fill).

Drafts are greedy (argmax). They only decide what gets verified: a wrong draft or a stale MTP
entry (a cached page whose last entry saw another continuation, a page finished without its
fill) costs acceptance, never correctness.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deltaserve.engine.requests.request import Request
from deltaserve.engine.runner.forward_batch import build_forward_batch

if TYPE_CHECKING:
    from deltaserve.engine.runner.forward_batch import ForwardBatch
    from deltaserve.engine.runner.model_runner import ModelRunner


@dataclass
class Computed:
    """What one request's row of the step computed: positions start..start+count-1, at rows
    start_row.. of the step's hidden states; `sampled`: it got a new token."""

    req: Request
    start: int
    count: int
    start_row: int
    sampled: bool


class MtpDrafter:
    def __init__(self, runner: ModelRunner, reserve_pages: Callable[[Request, int], bool], k: int) -> None:
        self.runner = runner
        self.reserve_pages = reserve_pages  # (req, num_tokens) -> bool, pages without preempting
        self.k = k
        self.page_size = runner.config.page_size
        self._drafts: weakref.WeakKeyDictionary[Request, list[int]] = weakref.WeakKeyDictionary()

    def take(self, req: Request) -> list[int]:
        """The drafts proposed after the request's last step (valid until its next step)."""
        return self._drafts.pop(req, [])

    @torch.inference_mode()
    def after_step(self, rows: list[Computed], room: dict[int, int]) -> None:
        """`room[id(req)]`: most drafts the request may take next step."""
        hidden = self.runner.last_hidden
        rows = [r for r in rows if not r.req.finished and r.count > 0]
        if hidden is None or not rows:
            return
        dev = hidden.device
        tokens = [r.req.all_token_ids[r.start + 1 : r.start + r.count + 1] for r in rows]
        batch = build_forward_batch(
            token_lists=tokens,
            starts=[r.start for r in rows],
            pages=[r.req.pages for r in rows],
            slots=[0] * len(rows),
            has_initial=[True] * len(rows),
            sample_mask=[r.sampled for r in rows],
            num_decodes=0,
            page_size=self.page_size,
            device=dev,
        )
        index = [r.start_row + j for r in rows for j in range(r.count)]
        ends = itertools.accumulate(len(t) for t in tokens)
        last = [(r.req, end - 1) for r, end in zip(rows, ends) if r.sampled]  # the sampled rows' last
        drafting = [req for req, _ in last if room.get(id(req), 0) > 0]
        at = [row for req, row in last if room.get(id(req), 0) > 0]  # each drafting request's row
        _, logits = self._run(batch, "step", index, at if drafting else None)
        if logits is None:
            return
        first = logits.argmax(dim=-1).tolist()
        drafts: dict[Request, list[int]] = {req: [int(t)] for req, t in zip(drafting, first)}
        for step in range(1, self.k):
            live = [
                req
                for req in drafting
                if len(drafts[req]) == step
                and room[id(req)] > step
                # the chained entry sits at num_tokens - 2 + step: it needs a page
                and self.reserve_pages(req, req.num_tokens - 1 + step)
            ]
            if not live:
                break
            keep = [drafting.index(req) for req in live]
            batch = build_forward_batch(
                token_lists=[[drafts[req][-1]] for req in live],
                starts=[req.num_tokens - 2 + step for req in live],
                pages=[req.pages for req in live],
                slots=[0] * len(live),
                has_initial=[True] * len(live),
                sample_mask=[True] * len(live),
                num_decodes=0,
                page_size=self.page_size,
                device=dev,
            )
            _, logits = self._run(batch, "mtp", [at[i] for i in keep], list(range(len(live))))
            assert logits is not None
            drafting, at = live, list(range(len(live)))  # the chained output's rows, in order
            for req, t in zip(live, logits.argmax(dim=-1).tolist()):
                drafts[req].append(int(t))
        for req, d in drafts.items():
            self._drafts[req] = d

    def _run(
        self, batch: ForwardBatch, base: str, rows: list[int], logits_rows: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MTP layer over a batch whose `input_ids` are the next tokens, fed `rows` of the
        step's hidden states (`base` "step") or of its own last output ("mtp"); out `[T, H]`,
        and the logits at `logits_rows` of it."""
        return self.runner.mtp_forward(batch, base, rows, logits_rows)
