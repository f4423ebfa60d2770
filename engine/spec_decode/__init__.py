"""Speculative decoding: drafts proposed per decoding request, verified by the target model in
the same forward as everything else, accepted by rejection sampling, committed to the state
pool from the window buffer.

The engine's hooks: the scheduler asks `propose` for each decoding request's drafts, the
linear backend runs verification rows through the window ops into `window`, and after the
forward `verify` gives each window's tokens and `commit` moves the accepted states into the
working slots (`commit.finish_windows`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from deltaserve.engine.requests.request import Request
from deltaserve.engine.sampling.sampler import Sampler
from deltaserve.engine.spec_decode.config import SpecConfig
from deltaserve.engine.spec_decode.mtp import Computed, MtpDrafter
from deltaserve.engine.spec_decode.ngram import NgramProposer
from deltaserve.engine.spec_decode.rejection import Verdict, verify_windows
from deltaserve.engine.spec_decode.state_window import StateWindow

__all__ = ["Computed", "Drafter", "MtpDrafter", "SpecConfig", "SpecDecoder", "StateWindow", "Verdict"]


class Drafter(Protocol):
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `tokens`."""
        ...


class SpecDecoder:
    def __init__(
        self,
        config: SpecConfig,
        window: StateWindow,
        sampler: Sampler,
        max_model_len: int,
        mtp: MtpDrafter | None = None,
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.window = window
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.drafter: Drafter = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
        self.mtp = mtp

    def room(self, req: Request) -> int:
        """Most drafts the request may verify now."""
        p = req.params
        assert p.max_tokens is not None
        # a window yields up to len(drafts) + 1 tokens and writes KV up to num_tokens + len(drafts)
        room = min(p.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens)
        return max(0, min(self.k, room))

    def propose(self, req: Request) -> list[int]:
        if req.matcher is not None or (req.thinking is not None and not req.thinking.done):
            # structured outputs and a reasoning budget: the mask needs each token before the
            return []  # next, which a verification window does not give it
        k = self.room(req)
        if self.mtp is not None:
            drafts = self.mtp.take(req)
        elif k > 0:
            drafts = self.drafter.propose(req.all_token_ids, k)
        else:
            drafts = []
        drafts = drafts[:k]
        if self.config.cuda_graph and k == self.k and len(drafts) < k:
            # uniform windows: pad with the last token proposed (any token is a valid draft:
            # it is accepted only where the target would have produced it)
            last = (
                drafts[-1]
                if drafts
                else req.output_token_ids[-1]
                if req.output_token_ids
                else req.prompt_token_ids[-1]
            )
            drafts = drafts + [last] * (k - len(drafts))
        return drafts

    def after_step(self, rows: list[Computed]) -> None:
        """MTP: fill its KV over what the step computed, draft for the next step."""
        if self.mtp is not None:
            self.mtp.after_step(rows, {id(r.req): self.room(r.req) for r in rows if not r.req.finished})

    def verify(self, logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]) -> list[Verdict]:
        return verify_windows(self.sampler, logits, reqs, drafts)
