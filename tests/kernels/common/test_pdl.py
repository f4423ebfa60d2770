"""Programmatic dependent launch: the switch, and a chain of our kernels captured in a CUDA
graph with PDL computing what the same kernels compute launched one after another without it."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.common import launch
from deltaserve.kernels.common.launch import PDL_AUTO_MAX_TOKENS, capturing_graph, pdl_enabled, pdl_mode


def test_pdl_switch(monkeypatch):
    monkeypatch.delenv("DELTASERVE_PDL", raising=False)
    assert pdl_mode() == "auto"
    monkeypatch.setenv("DELTASERVE_PDL", "on")
    assert pdl_mode() == "on"
    assert not pdl_enabled(torch.device("cpu"))  # the CPU interpreter has no griddepcontrol
    monkeypatch.setenv("DELTASERVE_PDL", "yes")
    with pytest.raises(ValueError, match="DELTASERVE_PDL"):
        pdl_mode()


def test_auto_uses_pdl_in_small_graphs_only(monkeypatch):
    monkeypatch.setattr(launch, "_pdl_capable", lambda device: True)  # as on a Hopper GPU
    dev = torch.device("cuda")
    for mode, outside, small, large in (
        ("auto", False, True, False),
        ("on", True, True, True),
        ("off", False, False, False),
    ):
        monkeypatch.setenv("DELTASERVE_PDL", mode)
        assert pdl_enabled(dev) is outside  # prefill and eager decode
        with capturing_graph(PDL_AUTO_MAX_TOKENS):
            assert pdl_enabled(dev) is small
        with capturing_graph(PDL_AUTO_MAX_TOKENS + 1):
            assert pdl_enabled(dev) is large
        assert pdl_enabled(dev) is outside


def _layers(x, res, weights):
    """A decode layer's worth of our kernels per step: add + RMSNorm, GEMV, output gate, GEMV
    with SwiGLU; each reads what the one before wrote, and the residual skips two kernels."""
    from deltaserve.kernels.linear.triton import gemv
    from deltaserve.kernels.norm import add_rms_norm, sigmoid_gate

    for norm_w, w_up, gate, w_down in weights:
        y, res = add_rms_norm(x, res, norm_w, 1e-6, True)
        h = gemv(y, w_up)  # [1, 2 * 1024]
        h = sigmoid_gate(h.view(1, 16, 128), gate).view(1, -1)
        x = gemv(h, w_down, silu_mul=True)  # [1, 1024]
    return x + res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_with_pdl_equals_plain_launches(monkeypatch):
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        pytest.skip("PDL needs compute capability 9.0 (the launches would be plain ones)")
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=g) * scale

    weights = [
        (
            rnd(1024, scale=0.1),
            rnd(2048, 1024, scale=1024**-0.5),
            rnd(1, 16, 128),
            rnd(1024, 1024, scale=0.03),
        )
        for _ in range(12)
    ]
    inputs = [(rnd(1, 1024), rnd(1, 1024)) for _ in range(5)]
    monkeypatch.setenv("DELTASERVE_PDL", "off")
    with torch.inference_mode():
        expected = [_layers(x, r, weights) for x, r in inputs]
    monkeypatch.setenv("DELTASERVE_PDL", "on")
    assert pdl_enabled(torch.device("cuda"))
    x_in, r_in = torch.zeros(1, 1024, device="cuda"), torch.zeros(1, 1024, device="cuda")
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _layers(x_in, r_in, weights)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _layers(x_in, r_in, weights)
        for (x, r), want in zip(inputs, expected):
            x_in.copy_(x)
            r_in.copy_(r)
            graph.replay()
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
