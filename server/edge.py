"""What is checked before a request's body is read: its API key and its size.

A pure ASGI middleware, so that a stranger's or an oversized upload is answered at once, without
a byte of its body in memory. A refusal closes the connection: the rest of that body is not read.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import HTTPException

from .errors import anthropic_request, error_body

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from .metrics import Metrics

MAX_BODY_BYTES = 32 * 1024 * 1024  # the default limit on a request's body
# the scope's key for when a request reached the server (time.monotonic): an /abort_request that
# named it while its prompt was prepared still ends it (`ServerContext.submit`)
ARRIVED = "deltaserve.arrived"
# what the key guards besides /v1 (/health, /metrics and /version stay open)
_KEYED = (
    "/generate",
    "/tokenize",
    "/detokenize",
    "/reset_prefix_cache",
    "/flush_cache",
    "/update_weights_from_disk",
    "/abort_request",
    "/update_weight_version",
)


class BodyTooLarge(HTTPException):
    """A body streamed past the limit; FastAPI passes it on to the app's 413 handler."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large(limit))


def too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes"


class EdgeGuard:
    """401 for a /v1, /generate, /tokenize or /detokenize request without the key (when one is set) and 413
    for a body over `max_body_bytes`: by its Content-Length before anything is read, and for a
    chunked body as soon as the bytes received pass the limit."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        metrics: Metrics,
        request_id_headers: bool = False,
    ) -> None:
        self.app = app
        self.request_id_headers = request_id_headers
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVED] = time.monotonic()
        headers = dict(scope["headers"])  # lower-case names (ASGI)
        if self.api_key is not None and _keyed_scope(scope) and not self._authorized(headers):
            message = "missing or invalid API key; send 'Authorization: Bearer <key>'"
            if anthropic_request(scope["path"], b"anthropic-version" in headers):  # its SDKs' header for it
                message = (
                    "missing or invalid API key; send 'x-api-key: <key>' (or 'Authorization: Bearer <key>')"
                )
            await self._refuse(send, 401, message, "invalid_api_key", scope["path"], headers)
            return
        limit = self.max_body_bytes
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await self._refuse(send, 413, too_large(limit), "request_too_large", scope["path"], headers)
            return
        received = 0
        started = False

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        request_id = headers.get(b"x-request-id")
        if request_id is None and self.request_id_headers:  # vLLM's --enable-request-id-headers: a fresh one
            request_id = uuid.uuid4().hex.encode()
        # Anthropic's SDKs read a response's id from request-id (`_request_id`, an error's request_id)
        anthropic = anthropic_request(scope["path"], b"anthropic-version" in headers)
        anthropic_id = anthropic_request_id() if anthropic else None

        async def send_started(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                added = (
                    [(b"x-request-id", request_id)] if request_id is not None else []
                )  # echoed, as vLLM does
                if anthropic_id is not None:
                    added.append((b"request-id", anthropic_id))
                if added:
                    message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        try:
            await self.app(scope, receive_within_limit, send_started)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(send, 413, too_large(limit), "request_too_large", scope["path"], headers)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self.api_key is not None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return True
        # Anthropic's SDKs send the key as x-api-key
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.api_key)

    async def _refuse(
        self, send: Send, status: int, message: str, code: str, path: str, headers: dict[bytes, bytes]
    ) -> None:
        from .api.messages import anthropic_error_body

        self.metrics.request_error(status)
        anthropic = anthropic_request(path, b"anthropic-version" in headers)
        shaped = (
            anthropic_error_body(status, message) if anthropic else error_body(status, message, None, code)
        )
        body = json.dumps(shaped).encode()
        response_headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        if anthropic:
            response_headers.append((b"request-id", anthropic_request_id()))
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})


def anthropic_request_id() -> bytes:
    """A fresh request-id header value, in Anthropic's form."""
    return f"req_{uuid.uuid4().hex}".encode()


def _keyed(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path.rstrip("/") in _KEYED


def _keyed_scope(scope: Scope) -> bool:
    """Whether the key guards the request, by its path as sent and as the routes see it: with
    --root-path uvicorn puts the proxy's prefix in front of `path`, and routing takes it off."""
    path, root = scope["path"], scope.get("root_path", "")
    return _keyed(path) or (bool(root) and path.startswith(root + "/") and _keyed(path[len(root) :]))
