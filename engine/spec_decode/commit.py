"""After a step with verification windows: each window's accepted tokens appended, and the state
after its last accepted position committed to the request's working slot."""

from __future__ import annotations

from deltaserve.engine.cache.adapter import PrefixCache, StateWrite
from deltaserve.engine.requests.outputs import RequestOutput
from deltaserve.engine.spec_decode.mtp import Computed
from deltaserve.engine.spec_decode.rejection import Verdict
from deltaserve.engine.spec_decode.state_window import StateWindow
from deltaserve.engine.step.scheduler import ScheduledChunk, SchedulerOutput
from deltaserve.engine.step.token_sink import TokenSink


def computed_rows(plan: SchedulerOutput, starts: list[int], verdicts: list[Verdict]) -> list[Computed]:
    """Per chunk, the positions the step computed (a window: its accepted prefix)."""
    rows, row, accepted = [], 0, iter(verdicts)
    for c, start in zip(plan.chunks, starts):
        count = next(accepted).num_accepted + 1 if c.drafts else c.num_tokens
        rows.append(Computed(c.req, start, count, row, c.sample))
        row += c.num_tokens
    return rows


def finish_windows(
    windows: list[ScheduledChunk],
    verdicts: list[Verdict],
    now: float,
    sink: TokenSink,
    window: StateWindow,
    prefix_cache: PrefixCache,
    page_size: int,
) -> list[RequestOutput]:
    """Append each window's accepted tokens, then commit the state after the last accepted
    position to the working slot and advance the request past it.

    Each token is appended once the window position before it counts as computed, and a page
    boundary among those positions hands its state to the prefix cache first, as plain decoding
    does: a request that stops inside its window (stop token, length) is released with the
    computed length and end snapshot that plain decoding would leave. A request that stops is
    not committed: its slot is freed unread."""
    outputs: list[RequestOutput] = []
    commits = []
    counters = sink.counters
    for row, (c, v) in enumerate(zip(windows, verdicts)):
        req = c.req
        req.num_draft_tokens += len(c.drafts)
        req.num_accepted_tokens += v.num_accepted
        counters["spec_draft_tokens_total"] += len(c.drafts)
        counters["spec_accepted_tokens_total"] += v.num_accepted
        counters["spec_windows_total"] += 1
        old = req.num_computed_tokens
        for i, (tok, lp) in enumerate(zip(v.tokens, v.logprobs)):
            req.num_computed_tokens = old + i + 1  # window position i: its state is in the window
            if req.num_computed_tokens % page_size == 0:
                # before the token that may stop the request; window to cache, not via the slot
                prefix_cache.on_computed(req, prefill=False, write=_window_write(window, row, i))
            sink.append(req, tok, lp, now)
            if req.finished:
                break
        if not req.finished:
            commits.append((req.slot or 0, row, v.num_accepted))
        sink.emit(outputs, req)
    # the working slots take their last accepted states at once: the one copy a window needs
    window.commit([s for s, _, _ in commits], [row for _, row, _ in commits], [a for _, _, a in commits])
    return outputs


def _window_write(window: StateWindow, row: int, position: int) -> StateWrite:
    """Writes the state after window `row`'s `position` into a slot (the prefix cache's)."""
    return lambda slot: window.commit([slot], [row], [position])
