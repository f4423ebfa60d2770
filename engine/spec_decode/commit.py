"""After a step with verification windows: each window's accepted tokens appended, and the state
after its last accepted position committed to the request's working slot."""

from __future__ import annotations

from deltaserve.engine.cache.adapter import PrefixCache
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

    A request that stops inside its window (stop token, length) is released with its slot
    and computed length as they were before the window: consistent, only a few tokens
    short for the prefix cache."""
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
        for tok, lp in zip(v.tokens, v.logprobs):
            sink.append(req, tok, lp, now)
            if req.finished:
                break
        if not req.finished:
            commits.append((req, row, v.num_accepted))
        sink.emit(outputs, req)
    ps = page_size
    for req, row, accepted in commits:
        # A page boundary crossed inside the window: the prefix cache sees the (accepted)
        # state there, as it would have in plain decoding.
        old = req.num_computed_tokens
        for pos in range(old - old % ps + ps, old + accepted + 1, ps):
            assert req.slot is not None
            window.commit([req.slot], [row], [pos - old - 1])
            req.num_computed_tokens = pos
            prefix_cache.on_computed(req, prefill=False)
        req.num_computed_tokens = old
    window.commit(
        [r.slot or 0 for r, _, _ in commits], [row for _, row, _ in commits], [a for _, _, a in commits]
    )
    for req, _, accepted in commits:
        req.num_computed_tokens += accepted + 1
        prefix_cache.on_computed(req, prefill=False)
    return outputs
