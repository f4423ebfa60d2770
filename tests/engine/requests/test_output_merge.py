"""A slow reader's queued outputs of one request merge into one (`RequestOutput.merge`)."""

from __future__ import annotations

from deltaserve.engine.requests.outputs import CompletionOutput, Logprob, RequestOutput


def _delta(
    tokens: list[int], text: str, prompt_logprobs: list[Logprob | None] | None = None
) -> RequestOutput:
    lps = [Logprob(t, -0.5, {}) for t in tokens]
    return RequestOutput(
        "r", [1, 2], [CompletionOutput(0, tokens, text, logprobs=lps)], False, delta=True,
        prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


def test_merged_deltas_join_tokens_and_keep_the_prompt_logprobs() -> None:
    """The prompt's log-probabilities ride on a delta stream's first output only: merged with the
    next one, they stay (a slow streamed echo's first chunk lost them)."""
    scored = [None, Logprob(2, -1.25, {})]
    merged = _delta([5], "a", scored).merge(_delta([6, 7], "bc"))
    (out,) = merged.outputs
    assert out.token_ids == [5, 6, 7] and out.text == "abc"
    assert [lp.token_id for lp in out.logprobs or []] == [5, 6, 7]
    assert merged.prompt_logprobs == scored
    assert _delta([5], "a").merge(_delta([6], "b", scored)).prompt_logprobs == scored
