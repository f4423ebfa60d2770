"""Replies built from pieces encoded apart: the bytes are the whole reply's, encoded at once."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from deltaserve.server.api.json_body import EncodedResponse, dumps, encode, encoded_list


def one_shot(value: Any, allow_nan: bool = False) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":")).encode()


ROWS = [None, {"5": {"logprob": -1.5, "rank": 1, "decoded_token": 'é "q" \x00'}}]


def test_spliced_parts_give_the_one_shot_bytes() -> None:
    rows = encode(ROWS)
    choice = {"index": 0, "text": "hi\n", "prompt_logprobs": rows, "meta": {"deep": rows, "n": 1.0}}
    reply = {"id": "x", "choices": encoded_list([encode(choice), encode({"index": 1})]), "usage": None}
    want = {
        "id": "x",
        "choices": [{**choice, "prompt_logprobs": ROWS, "meta": {"deep": ROWS, "n": 1.0}}, {"index": 1}],
        "usage": None,
    }
    assert encode(reply).data == one_shot(want)
    assert encoded_list([]).data == b"[]"


def test_strict_refuses_nan_as_the_reply_did_and_events_let_it_through() -> None:
    with pytest.raises(ValueError):
        encode({"a": encode([1]), "b": math.inf})
    assert encode({"a": encode([math.inf], strict=False)}, strict=False).data == one_shot(
        {"a": [math.inf]}, allow_nan=True
    )
    assert dumps([-math.inf], strict=False) == b"[-Infinity]"


def test_the_response_sends_the_body_in_megabyte_messages_with_its_length() -> None:
    big = encode(["x" * 700_000])
    body = encoded_list([big, big, encode({"k": 1})])
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(EncodedResponse(body)({"type": "http"}, None, send))  # type: ignore[arg-type]
    start, *messages = sent
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/json"
    whole = b"".join(m["body"] for m in messages)
    assert whole == body.data and headers[b"content-length"] == str(len(whole)).encode()
    assert len(messages) == 2 and [m["more_body"] for m in messages] == [True, False]
