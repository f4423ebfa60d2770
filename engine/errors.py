"""The errors that cross from the engine to its callers (the server maps each to a status)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine process exited or stopped answering; nothing it held will finish (HTTP 503)."""


class EngineFaultError(RuntimeError):
    """A step failed in a way no single request explains; the requests in flight were aborted."""


class InvalidParamError(ValueError):
    """A request's value is out of range or contradicts another (HTTP 400); `param` names the
    field as `SamplingParams` calls it, None when no one field is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[InvalidParamError], tuple[str, str | None]]:
        return type(self), (str(self), self.param)  # pickled with its field, not the message alone


class UpdateBusyError(ValueError):
    """A weight update arrived while another one is staged or waiting to be: one at a time, or
    the label, the path and the weights served could come from different updates."""


# the error types a reply from the engine process carries by kind, so the client raises the same
# type (the first that matches: InvalidParamError before the ValueError it is)
_REPLY_KINDS: dict[str, type[Exception]] = {
    "queue_full": QueueFullError,
    "invalid_param": InvalidParamError,
    "update_busy": UpdateBusyError,
    "value": ValueError,
}


def error_reply(exc: BaseException) -> tuple[str, str, str | None]:
    """An exception as the engine process's (kind, message, the field it names); `reply_error`
    turns it back."""
    for kind, exc_type in _REPLY_KINDS.items():
        if isinstance(exc, exc_type):
            return kind, str(exc), getattr(exc, "param", None)
    return "internal", f"{type(exc).__name__}: {exc}", None


def reply_error(kind: str, message: str, param: str | None = None) -> Exception:
    """The exception of a reply's (kind, message, param): the engine's own type, RuntimeError for
    the rest."""
    if kind == "invalid_param":
        return InvalidParamError(message, param)
    return _REPLY_KINDS.get(kind, RuntimeError)(message)
