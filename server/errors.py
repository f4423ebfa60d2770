"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import RequestOutput

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """Raised anywhere in a request's handling; the app turns it into OpenAI error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def renamed(self, names: Mapping[str, str]) -> APIError:
        """The error naming the field as the client sent it (`names`: our name -> theirs), in
        `param` and in the message."""
        if self.param is not None and self.param in names:
            new = names[self.param]
            self.message = re.sub(rf"\b{re.escape(self.param)}\b", new, self.message)
            self.args = (self.message,)
            self.param = new
        return self


def failure_of(exc: BaseException) -> tuple[int, str]:
    """The status and message for a request that the engine could not finish: 503 while the
    server drains or the engine is gone (retry elsewhere or later), else 500 with no internals."""
    from deltaserve.engine.errors import EngineDeadError, EngineFaultError, QueueFullError

    if isinstance(exc, APIError):
        return exc.status, exc.message
    if isinstance(exc, (QueueFullError, EngineDeadError)):
        return 503, str(exc)
    if isinstance(exc, EngineFaultError):
        return 500, str(exc)
    return 500, "internal error"


def failure_body(exc: BaseException) -> dict[str, Any]:
    """`failure_of`'s error as OpenAI's body, with the code the same failure gets as an HTTP
    reply (a stream's error event says what a refusal says: `shutting_down`, `queue_full`,
    `engine_unavailable`)."""
    from deltaserve.engine.errors import EngineDeadError, QueueFullError

    from .engine_client import ShuttingDownError

    status, message = failure_of(exc)
    if isinstance(exc, APIError):
        return error_body(status, message, exc.param, exc.code)
    code = None
    if isinstance(exc, QueueFullError):
        code = "shutting_down" if isinstance(exc, ShuttingDownError) else "queue_full"
    elif isinstance(exc, EngineDeadError):
        code = "engine_unavailable"
    return error_body(status, message, None, code)


class RequestFailedError(Exception):
    """The engine finished a request with finish_reason "error": a fault of that request alone,
    logged by the engine; its client learns only that it failed (500, no internals)."""


def raise_if_failed(out: RequestOutput) -> None:
    """A 400 with the engine's message where the request's own parameters failed it (they left no
    token to sample), else RequestFailedError."""
    for c in out.outputs:
        if c.finish_reason == "error" and c.bad_input:
            raise bad_request(
                c.error or "the request's parameters left no token to sample", None, "invalid_request"
            )
    if any(c.finish_reason == "error" for c in out.outputs):
        raise RequestFailedError(f"request {out.request_id} failed in the engine")


def anthropic_path(path: str) -> bool:
    """A route of Anthropic's Messages API, whose SDKs read Anthropic's error shape and request-id
    header (every other route's clients read OpenAI's); an unknown one under it (batches) too."""
    path = path.rstrip("/")
    return path.endswith("/v1/messages") or "/v1/messages/" in path


def anthropic_request(path: str, anthropic_version: bool) -> bool:
    """A request that Anthropic's shapes answer: a Messages API route's, or one of Anthropic's SDKs
    (which send an anthropic-version header) listing models, a route both APIs share."""
    path = path.rstrip("/")
    return (
        anthropic_path(path) or anthropic_version and (path.endswith("/v1/models") or "/v1/models/" in path)
    )


SHOWN_CHARS = 100  # of a request's name or id that an error quotes


def quoted(text: str) -> str:
    """`text` quoted as an error message names it, cut to its first `SHOWN_CHARS` characters: a
    megabyte of a model name is no megabyte of error."""
    if len(text) <= SHOWN_CHARS:
        return repr(text)
    return f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def refused(exc: ValueError) -> APIError:
    """The engine's refusal of a request (`SamplingParams`' checks, `InvalidParamError` with the
    field it names; any ValueError the engine raises for bad input) as a 400."""
    return bad_request(str(exc), getattr(exc, "param", None))


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def _union_tag(part: Any) -> bool:
    """A pydantic location part that names a union's form (`str`, `list[ContentPart]`), not a field:
    the API's fields are snake_case."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()
    )


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Summarise pydantic's errors into one message and the offending field's dotted path."""
    if not errors:
        return "invalid request", None
    # a value one of a union's forms fails is named by the form it went furthest into (a list of
    # content parts, not "should be a string"), without pydantic's tags for the forms
    first = max(errors, key=lambda e: len([p for p in e.get("loc", ()) if not _union_tag(p)]))
    where = list(first.get("loc", ()))
    if where[:1] in (["query"], ["path"]):  # a URL's parameter, named as sent: `limit`, not `query.limit`
        where = where[1:]
    loc = [str(p) for p in where if p != "body" and not _union_tag(p)]
    # a check of the whole body (protocol.RequestBody) names the field in its context
    param = ".".join(loc) or (first.get("ctx") or {}).get("param") or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, param
