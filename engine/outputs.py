"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The chosen token's log-probability and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # cumulative
    text: str  # cumulative, safe to show: stop strings trimmed, never a split character
    finish_reason: str | None = None  # None while running, then "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[Logprob] | None = None  # cumulative, when requested
    cumulative_logprob: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
