"""One request's life inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltaserve.engine.cache.radix_node import CacheHold
from deltaserve.engine.requests.cache_salt import salt_digest
from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
from deltaserve.engine.requests.outputs import Logprob
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.sampling.thinking_budget import ThinkingBudget
from deltaserve.models.vision.positions import ImagePrompt


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
    # the step whose prefill chunk left part of the prompt: its next chunk waits from there (the
    # prefill delay with `hold_prefill_tails`)
    ready_step: int = 0
    first_token_time: float | None = None
    scheduled_time: float | None = None  # when it first entered the running batch (time.time())
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
    # penalties: the prompt and output ids as numpy arrays (`TokenArrays`)
    token_arrays: TokenArrays | None = field(default=None, repr=False)
    # structured outputs: the grammar's state (xgrammar GrammarMatcher), fed every new token
    matcher: Any = field(default=None, repr=False)
    # thinking_token_budget: the reasoning's state (`ThinkingBudget`), fed every new token; None without one
    thinking: ThinkingBudget | None = field(default=None, repr=False)
    # allowed_token_ids as a [vocab] bool row, True outside them: built on the request's first
    # sampled step and reused, since rebuilding a near-vocabulary list every step slows the batch
    allowed_outside: torch.Tensor | None = field(default=None, repr=False)
    # logit_bias as device tensors (token ids, biases), likewise built once: gathering large
    # dicts every step slows the whole batch's host work
    logit_bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    grammar_broken: bool = False  # a token the grammar refused (the request ends there)
    # a fault of this request alone (its logit processing raised): it finishes with "error"
    error: str | None = None
    bad_input: bool = False  # the error is its own parameters' (they left no token): its client is told
    # a prompt with images: their inputs, the M-RoPE positions and the tower's embeddings
    images: ImagePrompt | None = field(default=None, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def cache_key_ids(self) -> list[int]:
        """The prefix cache's key: the tokens, with each image's tokens named by the image, and
        the first one folded with the request's `cache_salt`."""
        ids = self.all_token_ids if self.images is None else self.images.cache_ids + self.output_token_ids
        if self.params.cache_salt is not None and ids:
            ids[0] = salted_id(self.params.cache_salt, ids[0])
        return ids

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


def salted_id(salt: str, first: int) -> int:
    """A first key id that no token, no image id (`digest_ids`) and no other salt shares: only
    sequences with the same salt meet in the radix tree, since every path starts with its first page."""
    return -(1 << 48) - ((salt_digest(salt) << 64) | (first & ((1 << 64) - 1)))


@dataclass(eq=False)
class TokenArrays:
    """A request's prompt and output ids as numpy arrays; the output array grows with the list
    it mirrors (only the new tail is converted each step)."""

    prompt_ref: list[int]
    prompt: np.ndarray
    output_ref: list[int]
    output: np.ndarray
    filled: int = 0

    @classmethod
    def of(cls, req: Request) -> TokenArrays:
        cached = req.token_arrays
        if cached is None or cached.prompt_ref is not req.prompt_token_ids:
            cached = cls(
                req.prompt_token_ids,
                np.asarray(req.prompt_token_ids, dtype=np.int64),
                req.output_token_ids,
                np.empty(64, dtype=np.int64),
            )
            req.token_arrays = cached
        return cached

    def outputs(self, req: Request) -> np.ndarray:
        ids = req.output_token_ids
        if ids is not self.output_ref:  # a verification view (or a replaced list): convert it
            return np.asarray(ids, dtype=np.int64)
        n = len(ids)
        if n > self.output.shape[0]:
            grown = np.empty(max(n, 2 * self.output.shape[0]), dtype=np.int64)
            grown[: self.filled] = self.output[: self.filled]
            self.output = grown
        if n > self.filled:
            self.output[self.filled : n] = ids[self.filled : n]
        self.filled = n
        return self.output[:n]
