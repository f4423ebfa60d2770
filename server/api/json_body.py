"""Large JSON replies built in pieces: a part that repeats (a prompt's logprobs in each of its n
choices) is encoded once and spliced in wherever it appears, and the reply is sent piece by
piece; its bytes are the ones that encoding the whole reply at once gives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

_CHUNK = 1 << 20  # bytes a body message holds at least, but the last


@dataclass(frozen=True)
class Encoded:
    """A value's JSON text in pieces, encoded once, to be spliced into the replies that hold it."""

    parts: tuple[bytes, ...]

    @property
    def data(self) -> bytes:
        return b"".join(self.parts)


def dumps(value: Any, strict: bool = True) -> bytes:
    """`value`'s JSON as a reply sends it: FastAPI's JSONResponse's encoding (no NaN or infinity,
    a 500 as before) when `strict`, else the server-sent events' (which let them through)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=not strict, separators=(",", ":")).encode()


def encode(value: Any, strict: bool = True) -> Encoded:
    """`value` as `dumps` gives it, each `Encoded` in its dicts (at any depth of dicts) spliced in
    as it is; lists and other values are encoded whole."""
    if isinstance(value, Encoded):
        return value
    if not (isinstance(value, dict) and _holds_encoded(value)):
        return Encoded((dumps(value, strict),))
    parts: list[bytes] = [b"{"]
    for i, (key, item) in enumerate(value.items()):
        parts.append((b"," if i else b"") + dumps(str(key)) + b":")
        parts += encode(item, strict).parts
    parts.append(b"}")
    return Encoded(tuple(parts))


def encoded_list(items: list[Encoded]) -> Encoded:
    """A JSON array of values already encoded."""
    parts: list[bytes] = [b"["]
    for i, item in enumerate(items):
        if i:
            parts.append(b",")
        parts += item.parts
    parts.append(b"]")
    return Encoded(tuple(parts))


class EncodedResponse(Response):
    """An encoded body as JSONResponse would send it (its media type and length), sent in
    messages of about a megabyte: the server writes each and serves others while it drains."""

    media_type = "application/json"

    def __init__(self, body: Encoded) -> None:
        self.parts = body.parts
        super().__init__(headers={"content-length": str(sum(len(p) for p in body.parts))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for chunk, more in _chunks(self.parts):
            await send({"type": "http.response.body", "body": chunk, "more_body": more})


def _chunks(parts: tuple[bytes, ...]) -> Iterator[tuple[bytes, bool]]:
    """The parts joined into runs of at least `_CHUNK` bytes (the last may be shorter), each with
    whether more follow."""
    run: list[bytes] = []
    size = 0
    for part in parts:
        run.append(part)
        size += len(part)
        if size >= _CHUNK:
            yield b"".join(run), True
            run, size = [], 0
    yield b"".join(run), False


def _holds_encoded(value: dict[Any, Any]) -> bool:
    return any(isinstance(v, Encoded) or isinstance(v, dict) and _holds_encoded(v) for v in value.values())
