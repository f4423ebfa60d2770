"""The collector in a serving process: start-up's heap frozen out of it, young collections rare,
cyclic garbage still freed. Each check runs in a fresh interpreter, whose collector it may change."""

from __future__ import annotations

import subprocess
import sys

SETUP = """
import gc, weakref
from deltaserve.engine.gc_heap import freeze_startup_heap
startup = [[i] for i in range(50_000)]  # what loading leaves behind
freeze_startup_heap("test")
"""


def run(body: str) -> str:
    done = subprocess.run([sys.executable, "-c", SETUP + body], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_startup_objects_are_frozen_out_of_collections() -> None:
    assert int(run("print(gc.get_freeze_count())")) >= 50_000


def test_a_burst_of_serving_allocations_runs_no_collection() -> None:
    # one step's outputs for a few hundred requests: thousands of small containers, alive at once
    body = """
runs = []
gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
step = [{"id": i, "tokens": [i]} for i in range(3_000)]
print(len(runs))
"""
    assert run(body) == "0"


def test_cyclic_garbage_is_still_collected() -> None:
    body = """
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a
gone = []
ref = weakref.ref(a, lambda _: gone.append(True))
del a, b
churn = [[i] for i in range(200_000)]  # allocations past the raised thresholds
print(bool(gone))
"""
    assert run(body) == "True"
