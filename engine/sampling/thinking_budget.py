"""A reasoning budget (`SamplingParams.thinking_token_budget`, vLLM's): the output's reasoning,
`<think>` ... `</think>`, holds at most that many tokens; then `</think>` is the only token the
next position allows, and after it the model answers freely.

Reasoning is open at the output's start when the prompt left a `<think>` open (its last `<think>`
comes after its last `</think>`, as Qwen3.5's generation prompt leaves it), or opens when the
output's first token is `<think>` (Qwen3 writes its own). A `<think>` later in the output is
answer text, as the server's reasoning parser reads it, and nothing is forced for it. The tokens
counted are those after the opening, up to the budget; `</think>` itself is not one of them.
"""

from __future__ import annotations

from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"


def reasoning_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The tokenizer's `<think>` and `</think>` ids, or None where it lacks either (no reasoning to bound)."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    start, end = vocab.get(THINK_START), vocab.get(THINK_END)
    return None if start is None or end is None else (int(start), int(end))


def prompt_opens_reasoning(prompt: list[int], start: int, end: int) -> bool:
    """Whether the prompt's last `<think>` comes after its last `</think>`."""
    for token in reversed(prompt):
        if token == end:
            return False
        if token == start:
            return True
    return False


class ThinkingBudget:
    """One request's place in its reasoning: fed each output token, it says when to force the end."""

    def __init__(self, budget: int, start: int, end: int, inside: bool) -> None:
        self.budget = budget
        self.start = start
        self.end = end
        self.inside = inside  # reasoning is open
        self.done = False  # the reasoning ended, or the output did not open one
        self.used = 0  # reasoning tokens so far

    def accept(self, token: int) -> None:
        if self.done:
            return
        if not self.inside:
            self.inside = token == self.start
            self.done = not self.inside
        elif token == self.end:
            self.done = True
        else:
            self.used += 1

    @property
    def forcing(self) -> bool:
        """Whether the next token must be `</think>`: the reasoning is open and its budget spent."""
        return self.inside and not self.done and self.used >= self.budget
