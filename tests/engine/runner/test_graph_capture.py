"""The shared CUDA-graph capture: a garbage collection during a capture must not destroy
another graph (CUDA forbids that while a stream captures, and the capture is lost)."""

from __future__ import annotations

import gc

import pytest
import torch

from deltaserve.engine.runner.cuda_graphs import capture


class _Holder:
    """Keeps a graph alive through a reference cycle only (as an engine dropped earlier does)."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph
        self.me = self


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_survives_a_collection_that_would_free_an_old_graph():
    x = torch.arange(8.0, device="cuda")
    old, _ = capture(lambda: x * 3, None)
    garbage = [_Holder(old)]
    del old

    def body() -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            garbage.clear()  # the old graph becomes cyclic garbage in the middle of the capture
            for _ in range(2000):  # and allocations give the collector every chance to run
                a: list = []
                a.append(a)
        return x * 2 + 1

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graph, out = capture(body, None)
    finally:
        gc.set_threshold(*threshold)
    assert gc.isenabled()
    x.copy_(torch.arange(8.0, device="cuda") * 10)
    graph.replay()
    torch.testing.assert_close(out, x * 2 + 1)
    gc.collect()  # the old graph goes now, outside any capture
    torch.randn(4, device="cuda")  # the random generator is still usable
