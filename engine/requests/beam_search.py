"""Beam search as vLLM runs it: each step asks the engine for one token of every live beam with
the top 2 x beam_width log-probabilities (the prefix cache serves the shared prefixes), extends
every beam by each candidate, keeps the best beam_width of a prompt by score, and sets aside the
beams that end in a stop token. The score is the cumulative log-probability over the length
(prompt included, a final stop token not) to the power `length_penalty`.

`BeamSearch` is the bookkeeping alone, so that the offline `LLM.beam_search` and the server's
`use_beam_search` drive it with their own way of running a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from deltaserve.engine.requests.sampling_params import MAX_LOGPROBS


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature != 0.0:
            # the candidates' scores are the raw log-probabilities: a temperature would change nothing
            raise ValueError("beam search scores the raw log-probabilities: temperature must be 0")


@dataclass
class BeamSequence:
    """A beam: the prompt and its tokens, each generated token's candidates and their
    log-probabilities, their sum; `finish_reason` "stop" (a stop token ended it), "length" or "abort"."""

    tokens: list[int]
    num_prompt_tokens: int
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    text: str = ""

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    def text_ids(self, include_stop: bool) -> list[int]:
        """The output's ids to decode: the stop token that ended it left out unless asked for."""
        ids = self.output_ids
        return ids[:-1] if self.finish_reason == "stop" and not include_stop else ids


@dataclass
class BeamSearchOutput:
    """A prompt's best `beam_width` beams, best first."""

    sequences: list[BeamSequence]


def beam_score(beam: BeamSequence, stop_ids: frozenset[int], length_penalty: float) -> float:
    """The beam's rank, higher first: in the order of its cumulative log-probability over
    length ** length_penalty, taken in logs, where no penalty's power overflows or underflows a float."""
    length = len(beam.tokens) - (1 if beam.tokens[-1] in stop_ids else 0)
    if beam.cum_logprob >= 0.0:  # a certain beam scores 0 at every length: the best there is
        return math.inf
    return length_penalty * math.log(length) - math.log(-beam.cum_logprob)


class BeamSearch:
    def __init__(
        self, prompts: Sequence[list[int]], params: BeamSearchParams, stop_ids: Sequence[int]
    ) -> None:
        self.params = params
        self.stop_ids = frozenset(stop_ids)
        self.live = [[BeamSequence(list(p), len(p))] for p in prompts]
        self.ended: list[list[BeamSequence]] = [[] for _ in prompts]
        self.steps = 0
        self.aborted = False  # a step was aborted (/abort_request): the live beams end as they are

    @property
    def finished(self) -> bool:
        return self.aborted or self.steps >= self.params.max_tokens or not any(self.live)

    def expanding(self) -> list[list[int]]:
        """The token ids of every live beam, prompt by prompt: the next step's prompts."""
        return [beam.tokens for beams in self.live for beam in beams]

    def _score(self, beam: BeamSequence) -> float:
        return beam_score(beam, self.stop_ids, self.params.length_penalty)

    def advance(self, candidates: Sequence[dict[int, float]]) -> None:
        """One step: `candidates[i]`, the next token's log-probabilities for `expanding()[i]`."""
        it = iter(candidates)
        for i, beams in enumerate(self.live):
            grown: list[BeamSequence] = []
            for beam in beams:
                top = next(it)
                for token, logprob in top.items():
                    new = BeamSequence(
                        beam.tokens + [token],
                        beam.num_prompt_tokens,
                        beam.logprobs + [top],
                        beam.cum_logprob + logprob,
                    )
                    if token in self.stop_ids and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        self.ended[i].append(new)
                    else:
                        grown.append(new)
            self.live[i] = sorted(grown, key=self._score, reverse=True)[: self.params.beam_width]
        self.steps += 1

    def outputs(self) -> list[BeamSearchOutput]:
        outs = []
        for live, ended in zip(self.live, self.ended):
            for beam in live:
                beam.finish_reason = "abort" if self.aborted else "length"
            best = sorted(ended + live, key=self._score, reverse=True)[: self.params.beam_width]
            outs.append(BeamSearchOutput(best))
        return outs
