"""A streamed token's chunk is filled into a template rendered once (Generation.text_event): for
any text it must be exactly the event that building and dumping the chunk's models gives."""

from __future__ import annotations

import random

import pytest

from deltaserve.server.api.chat import ChatGeneration
from deltaserve.server.api.completions import CompletionGeneration
from deltaserve.server.protocol import (
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
)

ALPHABET = (
    [chr(c) for c in range(0x20)]  # control characters, escaped in JSON
    + list("\"\\/<>&'{}[]:, abcXYZ019")
    + ["é", "日", "🙂", "\u2028", "\u2029", "\x7f", "\ufffd"]
)


def texts(n: int = 300) -> list[str]:
    rng = random.Random(0)
    return [""] + ["".join(rng.choices(ALPHABET, k=rng.randint(1, 12))) for _ in range(n)]


@pytest.mark.parametrize("index", [0, 3])
def test_completion_text_event_is_the_models_event(index: int) -> None:
    gen = CompletionGeneration(None, CompletionRequest(model="m", prompt="x"), "m")  # type: ignore[arg-type]

    def choice(text: str) -> CompletionChoice:
        return CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None)

    for text in texts():
        assert gen.text_event(index, text, choice) == gen.event([choice(text)])


def test_chat_text_event_is_the_models_event() -> None:
    gen = ChatGeneration.__new__(ChatGeneration)  # the chunk's fields only: no request to prepare
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    super(ChatGeneration, gen).__init__(None, "m", req)  # type: ignore[arg-type]

    def choice(text: str) -> ChatChunkChoice:
        return ChatChunkChoice(index=0, delta=ChatDelta(content=text))

    for text in texts():
        assert gen.text_event(0, text, choice) == gen.event([choice(text)])
