"""Where a step's tokens go: each request's output list, logprobs and grammar, its stop checks
and finishing, and the `RequestOutput`s the step hands back."""

from __future__ import annotations

import logging
from typing import Any

from deltaserve.engine.requests.outputs import PackedOutput, RequestOutput, unpack_outputs
from deltaserve.engine.requests.request import Request
from deltaserve.engine.requests.stop_checks import (
    check_stop,
    stop_token_verdict,
    visible_length,
    visible_text,
)
from deltaserve.engine.step.scheduler import Scheduler

logger = logging.getLogger(__name__)

COUNTERS = (
    "prompt_tokens_total",
    "prefill_tokens_total",  # left to prefill at admission: prompts less cache hits, and recomputes
    "generation_tokens_total",
    "cached_tokens_total",
    "spec_draft_tokens_total",
    "spec_accepted_tokens_total",
    "spec_windows_total",
    "preemptions_total",  # running requests preempted (their pages and slot freed, recomputed later)
)


def new_counters() -> dict[str, int]:
    """The engine's running totals (`Engine.stats`), all at zero."""
    return dict.fromkeys(COUNTERS, 0)


class TokenSink:
    """Appends tokens to their requests and finishes the requests that stop; `requests` is the
    engine's table of live requests (a finished one leaves it) and `counters` its totals."""

    def __init__(
        self,
        scheduler: Scheduler,
        requests: dict[str, Request],
        counters: dict[str, int],
        eos_token_ids: list[int],
        max_model_len: int,
        stream_interval: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.counters = counters
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stream_interval = stream_interval
        # outputs as `pack_outputs` packs them, prompt ids left out (`Engine.emit_packed_outputs`): the
        # engine process sends them so, with no RequestOutput to build and then take apart
        self.packed = False

    def append(self, req: Request, tok: int, lp: Any, now: float) -> None:
        self.record(req, tok, lp, now)
        self.check(req, tok)

    def record(self, req: Request, tok: int, lp: Any, now: float) -> None:
        if req.error is not None:  # sampled from logits its processing could not touch: not its token
            return
        if req.first_token_time is None:
            req.first_token_time = now
        req.output_token_ids.append(tok)
        self.counters["generation_tokens_total"] += not req.params.internal
        if req.thinking is not None:
            req.thinking.accept(tok)
        if req.matcher is not None and not req.matcher.accept(tok):
            req.matcher = None  # cannot happen under the mask; never feed a broken state again
            req.grammar_broken = True
        if lp is not None and req.logprobs is not None:
            req.logprobs.append(lp)
            req.cumulative_logprob += lp.logprob

    def check(self, req: Request, tok: int) -> None:
        """Detokenize the newest token and apply the stop conditions. A request whose own part of
        the step failed (`Request.error`, or an exception here) finishes with "error" alone."""
        verdict = None
        if req.error is None:
            try:
                checked = req.detokenizer.length
                # the token that stops a request is not in its text unless asked for, as in vLLM;
                # nor the end of sequence that completed a grammar (ignore_eos lets no other stop it)
                by_token = stop_token_verdict(req, tok, self.eos_token_ids)
                ends_grammar = req.matcher is not None and req.matcher.terminated
                if (by_token is None and not ends_grammar) or req.params.include_stop_str_in_output:
                    req.detokenizer.append(tok)
                verdict = check_stop(req, by_token, self.max_model_len, checked)
            except Exception as exc:
                logger.exception("detokenizing or stop checks failed for request %s", req.request_id)
                req.error = f"stop checks failed ({type(exc).__name__})"
        if req.error is not None:
            verdict = ("error", None)
        elif verdict is None and (req.grammar_broken or (req.matcher is not None and req.matcher.terminated)):
            verdict = ("stop", None)  # the grammar is complete (its stop token accepted)
        if verdict is not None:
            self.finish(req, *verdict)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        # a matched stop string already cut the text; a failed request's text is not trusted
        if not isinstance(stop_reason, str) and reason != "error":
            req.detokenizer.flush()
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.num_placeholders = 0  # overlap: the token sampled after the stop is dropped
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> RequestOutput | PackedOutput | None:
        """End a live request as "abort": its last output (packed as `packed` says), or None for an
        unknown id."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req)
        req.num_placeholders = 0  # a token in flight for it is dropped when read back
        req.finish_reason = "abort"
        return self._output(req)

    def emit(self, outputs: list[Any], req: Request) -> None:
        """A step's output for the request (`output_kind`): every step, every step that added
        tokens (the first token at once, then at least `stream_interval` at a time), or only
        the last."""
        kind = req.params.output_kind
        if req.finish_reason is not None or kind == "cumulative" or (kind == "delta" and self._due(req)):
            outputs.append(self._output(req))

    def _output(self, req: Request) -> RequestOutput | PackedOutput:
        """The request's output now, packed as `packed` says (prompt ids left out when packed)."""
        return output_fields(req, []) if self.packed else build_output(req)

    def _due(self, req: Request) -> bool:
        sent = req.num_sent_tokens
        new = len(req.output_token_ids) - sent
        interval = max(self.stream_interval, req.params.stream_interval or 1)
        return new > 0 and (sent == 0 or new >= interval)


def build_output(req: Request) -> RequestOutput:
    """The request's output now; a delta output marks what it carries as sent."""
    return unpack_outputs([output_fields(req, req.prompt_token_ids)])[0]


def output_fields(req: Request, prompt_token_ids: list[int]) -> PackedOutput:
    """`build_output`'s output as `pack_outputs` packs it (its fields in order, its completion's
    after), with `prompt_token_ids` for the prompt's; a delta output marks what it carries as sent."""
    delta = req.params.output_kind == "delta"
    n_tokens = len(req.output_token_ids)
    if delta:  # only what is new: the cost does not grow with the output
        start, chars = req.num_sent_tokens, visible_length(req)
        token_ids = req.output_token_ids[start:]
        text = req.detokenizer.slice(req.num_sent_chars, chars)
        logprobs = req.logprobs[start:] if req.logprobs is not None else None
        req.num_sent_tokens, req.num_sent_chars = n_tokens, chars
    else:
        token_ids = list(req.output_token_ids)
        text = visible_text(req)
        logprobs = list(req.logprobs) if req.logprobs is not None else None
    prompt_logprobs = None
    whole = req.prompt_logprobs is not None and len(req.prompt_logprobs) == len(req.prompt_token_ids)
    if whole and not (delta and req.prompt_logprobs_sent):
        prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
    # RequestOutput's fields but its completions, then CompletionOutput's (tests hold the order to
    # pack_outputs'): no prompt text, the one completion at index 0
    finished = req.finish_reason is not None
    head = (
        req.request_id, prompt_token_ids, finished, None, req.num_cached_tokens, req.arrival_time,
        req.first_token_time, req.num_draft_tokens, req.num_accepted_tokens, delta, prompt_logprobs,
        req.scheduled_time,
    )  # fmt: skip
    completion = (
        0, token_ids, text, req.finish_reason, req.stop_reason, logprobs, req.cumulative_logprob,
        n_tokens, req.error, req.bad_input,
    )  # fmt: skip
    return head, [completion]
