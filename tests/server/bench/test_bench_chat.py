"""bench.serving.chat_sessions against a real server on the built-in model: multi-turn sessions with
retries through the chat template, the prefix cache's share of each prompt against the ideal."""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest

from bench.serving.chat_sessions import SentPrompts, Turn, main, summarize

pytestmark = pytest.mark.slow


def test_longest_prefix_with_any_earlier_prompt() -> None:
    rng = random.Random(0)
    sent = SentPrompts()
    seen: list[tuple[int, ...]] = []
    for _ in range(300):  # short prompts over a tiny alphabet, so that prefixes are often shared
        ids = tuple(rng.randrange(3) for _ in range(rng.randint(0, 8)))
        brute = 0
        for old in seen:
            n = 0
            while n < min(len(old), len(ids)) and old[n] == ids[n]:
                n += 1
            brute = max(brute, n)
        assert sent.longest_prefix(ids) == brute, (ids, seen)
        sent.add(ids)
        seen.append(ids)


def test_summary_shares() -> None:
    args = argparse.Namespace(turns=2, output_json=None)
    turns = [
        Turn(0, 1, False, prompt_tokens=100, cached_tokens=0, ideal_tokens=40, ttft=0.2),
        Turn(0, 2, False, prompt_tokens=200, cached_tokens=96, ideal_tokens=100, ttft=0.1),
        Turn(0, 2, True, prompt_tokens=200, cached_tokens=192, ideal_tokens=200, ttft=0.05),
        Turn(1, 1, False, prompt_tokens=100, error="HTTP 500"),
    ]
    result = summarize(args, turns, 1.0)
    assert result["all"]["failed"] == 1 and result["all"]["prompt_tokens"] == 500
    assert result["later_turns"]["cached_over_ideal"] == pytest.approx(0.96)
    assert result["retries"]["cached_share"] == pytest.approx(0.96)
    assert result["by_turn"]["turn 1"]["ideal_share"] == pytest.approx(0.4)


def test_chat_sessions_hit_the_prefix_cache(server: Any) -> None:
    argv = ["--base-url", server.url, "--sessions", "4", "--concurrency", "2", "--turns", "3"]
    argv += ["--system-words", "120", "--user-words", "20", "--max-tokens", "8", "--retry-every", "2"]
    result = main(argv)
    assert result["all"]["failed"] == 0
    assert result["all"]["requests"] == 4 * (3 + 1)  # turn 2 of each session is sent twice
    turns = [result["by_turn"][f"turn {n}"] for n in (1, 2, 3)]
    # each turn's prompt holds the last one's plus an answer and a new question
    assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]
    # later turns and retries: the whole earlier prompt is served from the cache (all but a page)
    assert result["later_turns"]["cached_over_ideal"] >= 0.9
    assert result["retries"]["cached_share"] >= 0.9
    # sessions after the first branch off the shared system prompt
    assert result["first_turns"]["cached_tokens"] > 0
