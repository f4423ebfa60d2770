"""One definition per error type, and the engine's errors reach the server as their own types."""

from __future__ import annotations

import ast
import pathlib

import pytest

from deltaserve.engine.errors import InvalidParamError, QueueFullError, error_reply, reply_error
from deltaserve.server.errors import failure_of

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "exc",
    [
        QueueFullError("the waiting queue is full"),
        ValueError("prompt too long"),
        InvalidParamError("priority 1 needs priority scheduling", "priority"),
    ],
)
def test_an_error_crosses_the_process_boundary_as_its_type(exc):
    back = reply_error(*error_reply(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert getattr(back, "param", None) == getattr(exc, "param", None)  # the field a 400 names


def test_other_errors_cross_as_runtime_errors_naming_their_type():
    back = reply_error(*error_reply(KeyError("slot")))
    assert type(back) is RuntimeError and "KeyError" in str(back)


def test_a_full_queue_after_the_crossing_is_503():
    assert failure_of(reply_error(*error_reply(QueueFullError("full"))))[0] == 503
    assert failure_of(reply_error(*error_reply(KeyError("slot"))))[0] == 500


def test_each_exception_class_is_defined_once():
    defined: dict[str, list[str]] = {}
    for top in ("engine", "models", "kernels", "server", "deltaserve"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Exception")):
                    defined.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert "QueueFullError" in defined  # the scan sees the engine's errors
    assert {name: paths for name, paths in defined.items() if len(paths) > 1} == {}
