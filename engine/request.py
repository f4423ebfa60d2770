"""One request's life inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.outputs import Logprob
from deltaserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deltaserve.engine.cache.adapter import CacheHold
    from deltaserve.engine.sampling.penalties import TokenArrays


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # the prefix-cache hit at first admission
    num_preemptions: int = 0
    slot: int | None = None
    # With a prefix-cache hit the head of `pages` is the cache's: read, never written or freed.
    pages: list[int] = field(default_factory=list)
    prefix: CacheHold | None = None  # what the request holds of the radix cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None
    # each prompt token's log-probability given the tokens before it (the first None), filled
    # as the prefill runs (`SamplingParams.prompt_logprobs`)
    prompt_logprobs: list[Logprob | None] | None = None
    prompt_logprobs_sent: bool = False  # delta outputs carry them once
    cumulative_logprob: float = 0.0
    arrival_time: float = field(default_factory=time.time)
    arrival_step: int = 0  # the scheduler's step count when the request was added
    first_token_time: float | None = None
    # set when the request's state slot starts from a copied snapshot (prefix-cache hit)
    has_initial_state: bool = False
    # speculative decoding, cumulative: drafts verified, and how many of them were accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # overlap scheduling: tokens sampled on the device and not yet read back (0 or 1); they
    # count as the sequence's last tokens, and the next decode takes its input from the device
    num_placeholders: int = 0
    # output_kind "delta": how much of the output earlier outputs carried (tokens, characters)
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    # penalties: the prompt and output ids as numpy arrays (engine/sampling/penalties.py `TokenArrays`)
    token_arrays: TokenArrays | None = field(default=None, repr=False)
    # structured outputs: the grammar's state (xgrammar GrammarMatcher), fed every new token
    matcher: Any = field(default=None, repr=False)
    grammar_broken: bool = False  # a token the grammar refused (the request ends there)
    # a fault of this request alone (its logit processing raised): it finishes with "error"
    error: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (a decode step needs one)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_placeholders

    @property
    def ends_with_placeholder(self) -> bool:
        """Its one unread token is its last by length: no decode step after it is needed."""
        p = self.params.max_tokens
        return self.num_placeholders > 0 and p is not None and len(self.output_token_ids) + 1 >= p

    @property
    def num_pending(self) -> int:
        """Tokens not yet run through the model (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
