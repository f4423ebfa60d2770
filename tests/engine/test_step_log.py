"""The engine's debug log: a line a step with what the step runs, a timeline of the engine."""

from __future__ import annotations

import logging
import re

from deltaserve import LLM, SamplingParams

LINE = re.compile(
    r"step: (\d+) decodes, (\d+) verifications, (\d+) prefill chunks of (\d+) tokens; (?:[\d.]+ ms|-) since the last"
)


def test_debug_log_has_a_line_a_step_with_its_work(make_checkpoint, caplog) -> None:
    llm = LLM(make_checkpoint("qwen3_next"))
    prompt = list(range(100))
    with caplog.at_level(logging.DEBUG, logger="deltaserve.engine.engine"):
        out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    steps = [tuple(int(g) for g in m.groups()) for m in map(LINE.search, caplog.messages) if m]
    generated = len(out[0].outputs[0].token_ids)
    # every token computed once: the prompt's, then each generated one but the last
    assert sum(s[0] + s[3] for s in steps) == len(prompt) + generated - 1
    assert (
        sum(s[3] for s in steps) >= len(prompt) - 1
    )  # the prompt in prefill chunks (its last token may decode)
    assert all(s[1] == 0 for s in steps)
