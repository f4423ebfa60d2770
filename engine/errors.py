"""The errors that cross from the engine to its callers (the server maps each to a status)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine process exited or stopped answering; nothing it held will finish (HTTP 503)."""


class EngineFaultError(RuntimeError):
    """A step failed in a way no single request explains; the requests in flight were aborted."""
