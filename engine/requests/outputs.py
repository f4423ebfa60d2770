"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any


@dataclass
class Logprob:
    """The chosen token's log-probability and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None  # the token's among the whole vocabulary, 1 the likeliest
    # logprob_token_ids' values (prompt_logprob_token_ids' at a prompt position)
    asked: dict[int, float] = field(default_factory=dict)


@dataclass
class TokenLogprob:
    """vLLM's `Logprob`: one token's log-probability at a position, its rank among the whole
    vocabulary (1 the likeliest) and its text (None without detokenization)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PositionLogprobs(dict[int, TokenLogprob], Logprob):
    """One position's log-probabilities as vLLM's offline outputs hold them (`LLM.generate`'s
    `logprobs` and `prompt_logprobs`): token id -> TokenLogprob, the chosen token first, then the
    top ones best first, then the asked ids' (`logprob_token_ids`, `prompt_logprob_token_ids`).
    It is the engine's Logprob too: its fields (token_id, logprob, top, rank, asked) read as before."""

    def __init__(self, lp: Logprob, decode: Callable[[int], str] | None = None) -> None:
        dict.__init__(self)
        Logprob.__init__(self, lp.token_id, lp.logprob, lp.top, lp.rank, lp.asked)

        def entry(token_id: int, value: float, rank: int | None) -> TokenLogprob:
            return TokenLogprob(value, rank, decode(token_id) if decode is not None else None)

        self[lp.token_id] = entry(lp.token_id, lp.logprob, lp.rank)
        for rank, (token_id, value) in enumerate(sorted(lp.top.items(), key=lambda kv: -kv[1]), 1):
            if token_id not in self:
                self[token_id] = entry(token_id, value, rank)
        for token_id, value in lp.asked.items():
            if token_id not in self:
                self[token_id] = entry(token_id, value, None)

    __eq__ = dict.__eq__  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]
    __repr__ = dict.__repr__  # type: ignore[assignment]


@dataclass
class CompletionOutput:
    """One completion so far. With `output_kind="delta"` token_ids, text and logprobs hold only
    what is new since the request's previous output (`RequestOutput.delta`)."""

    index: int
    token_ids: list[int]  # cumulative (new ones only in a delta output)
    text: str  # cumulative, safe to show: stop strings trimmed, never a split character
    finish_reason: str | None = None  # None while running, then "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[Logprob] | None = None  # cumulative, when requested
    cumulative_logprob: float | None = 0.0  # LLM.generate: None where logprobs were not asked for
    num_tokens: int = -1  # tokens generated so far, in every kind of output (-1: len(token_ids))
    error: str | None = None  # with finish_reason "error": what failed (for logs, not for clients)
    bad_input: bool = False  # ... unless its own parameters failed it: then its client reads `error`

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)

    def finished(self) -> bool:
        """vLLM's (a method there too, unlike RequestOutput.finished): whether it has ended."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """vLLM's `RequestOutput.metrics`: a request's times, in time.time() seconds (None where a
    time did not come: a prompt that never gave a token)."""

    arrival_time: float
    last_token_time: float | None
    first_scheduled_time: float | None  # when it first entered the running batch
    first_token_time: float | None
    time_in_queue: float | None  # arrival to first scheduled
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding, cumulative: draft tokens verified
    num_accepted_tokens: int = 0  # ... and accepted
    delta: bool = False  # the completions carry only what is new since the previous output
    # the prompt's tokens' log-probabilities (the first None), once the whole prompt has run
    prompt_logprobs: list[Logprob | None] | None = None
    scheduled_time: float | None = None  # when it first entered the running batch (queue time's end)
    # vLLM's: LLM.generate's outputs have their times here, None elsewhere; never packed, so last
    metrics: RequestMetrics | None = None

    def merge(self, newer: RequestOutput) -> RequestOutput:
        """This output and the same request's next one as one output: deltas are joined, a
        cumulative output supersedes what came before it."""
        if not newer.delta:
            return newer
        if newer.prompt_logprobs is None:  # a delta stream carries them once, in its first output
            newer.prompt_logprobs = self.prompt_logprobs
        for old, new in zip(self.outputs, newer.outputs):
            new.token_ids = old.token_ids + new.token_ids
            new.text = old.text + new.text
            if old.logprobs is not None and new.logprobs is not None:
                new.logprobs = old.logprobs + new.logprobs
        return newer


# A step's outputs cross to the HTTP process as plain tuples: pickling dataclasses goes through
# each object's __reduce_ex__ and state dict, several times the cost of its fields as a tuple.
_REQUEST_FIELDS = tuple(f.name for f in fields(RequestOutput) if f.name not in ("outputs", "metrics"))
_COMPLETION_FIELDS = tuple(f.name for f in fields(CompletionOutput))
_OUTPUTS_AT = [f.name for f in fields(RequestOutput)].index("outputs")

PackedOutput = tuple[Any, ...]


def pack_outputs(outputs: list[RequestOutput]) -> list[PackedOutput]:
    """The outputs as tuples of their fields, theirs then their completions'."""
    req_get, comp_get = attrgetter(*_REQUEST_FIELDS), attrgetter(*_COMPLETION_FIELDS)
    return [(req_get(out), [comp_get(c) for c in out.outputs]) for out in outputs]


_ID_AT, _FINISHED_AT = _REQUEST_FIELDS.index("request_id"), _REQUEST_FIELDS.index("finished")


def packed_head(packed: PackedOutput) -> tuple[str, bool]:
    """A packed output's request id and whether it is the request's last."""
    head = packed[0]
    return head[_ID_AT], head[_FINISHED_AT]


def unpack_outputs(packed: list[PackedOutput]) -> list[RequestOutput]:
    """`pack_outputs`' outputs back as RequestOutput objects."""
    at = _OUTPUTS_AT
    return [
        RequestOutput(*head[:at], [CompletionOutput(*c) for c in comps], *head[at:])  # type: ignore[call-arg]
        for head, comps in packed
    ]
