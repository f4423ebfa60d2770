"""The Triton MoE router against the torch routing rules on CUDA."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.router import reference as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def sorted_pairs(ids, weights):
    order = ids.sort(dim=-1)
    return order.values, weights.gather(1, order.indices)


@pytest.mark.parametrize("e,k", [(256, 8), (512, 10), (64, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk(e, k, renormalize):
    from deltaserve.kernels.router.triton import topk_route_launch

    g = torch.Generator(device="cuda").manual_seed(e)
    logits = torch.randn(33, e, device="cuda", generator=g)  # fp32: no ties
    ids, w = topk_route_launch(logits, None, k, renormalize, 1.0, sigmoid=False)
    ref_ids, ref_w = R.softmax_topk_ref(logits, k, renormalize)
    assert torch.equal(ids, ref_ids)  # both in descending weight order
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("e,k", [(512, 10), (6, 5)])
def test_ties_go_to_the_lowest_index(e, k):
    """Logits of a few distinct values: among equal weights the lower expert id is chosen first,
    as a stable descending sort orders them."""
    from deltaserve.kernels.router.triton import topk_route_launch

    g = torch.Generator(device="cuda").manual_seed(e)
    logits = torch.randint(-3, 3, (33, e), device="cuda", generator=g).float()
    ids, _ = topk_route_launch(logits, None, k, False, 1.0, sigmoid=False)
    assert torch.equal(ids, torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :k])


def test_sigmoid_topk_with_bias_and_scaling():
    from deltaserve.kernels.router.triton import topk_route_launch

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(33, 256, device="cuda", generator=g)
    bias = torch.randn(256, device="cuda", generator=g) * 0.1
    ids, w = topk_route_launch(logits, bias, 8, True, 2.446, sigmoid=True)
    ref = R.sigmoid_topk_ref(logits.sigmoid(), bias, 8, True, 2.446)
    got, want = sorted_pairs(ids, w), sorted_pairs(*ref)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("e,k", [(512, 10), (64, 4), (6, 5)])
def test_shared_expert_follows_the_routed_ones(e, k):
    """A shared expert fused as expert E: softmax over the first E columns, then E weighted by the
    sigmoid of column E (Qwen's gate); or, after sigmoid routing, weighted by one (Kimi's)."""
    from deltaserve.kernels.router.triton import topk_route_launch

    g = torch.Generator(device="cuda").manual_seed(e)
    logits = torch.randn(33, e + 1, device="cuda", generator=g)
    ids, w = topk_route_launch(logits, None, k, True, 1.0, sigmoid=False, shared=1)
    ref_ids, ref_w = R.with_shared(*R.softmax_topk_ref(logits[:, :e], k, True), e, logits[:, e])
    assert ids.shape == (33, k + 1) and torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)

    logits = logits[:, :e].contiguous()
    bias = torch.randn(e, device="cuda", generator=g) * 0.1
    ids, w = topk_route_launch(logits, bias, k, True, 2.446, sigmoid=True, shared=2)
    ref_ids, ref_w = R.sigmoid_topk_ref(logits.sigmoid(), bias, k, True, 2.446)
    got, want = sorted_pairs(ids[:, :k], w[:, :k]), sorted_pairs(ref_ids, ref_w)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    assert (ids[:, k] == e).all() and (w[:, k] == 1).all()


def test_weights_rounded_to_the_model_dtype_in_fp32():
    """The weights as the model's bf16 product would take them, stored in fp32 so that the fused
    MoE reads them without a conversion launch."""
    from deltaserve.kernels.router.triton import topk_route_launch

    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(33, 129, device="cuda", generator=g)
    ids, w = topk_route_launch(logits, None, 8, True, 1.0, False, 1, torch.bfloat16)
    ref_ids, ref_w = topk_route_launch(logits, None, 8, True, 1.0, False, 1)
    assert w.dtype == torch.float32 and torch.equal(ids, ref_ids)
    assert torch.equal(w, ref_w.to(torch.bfloat16).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("e,k,pad", [(512, 10, 15), (256, 8, 15), (64, 4, 0)])
def test_router_gemv_and_routing_in_one_launch(e, k, pad, m, dtype):
    """The router's GEMV whose last program routes the tokens (Qwen's softmax top-k and the fused
    shared expert) gives the GEMV's logits routed by the router kernel, bit for bit, and leaves
    its arrival count at zero; then again from a CUDA graph."""
    from deltaserve.kernels.common import arrival
    from deltaserve.kernels.linear.triton import gemv
    from deltaserve.kernels.router.triton import gemv_route_launch, topk_route_launch

    g = torch.Generator(device="cuda").manual_seed(e + m)
    h = 2048
    w = (torch.randn(e + 1 + pad, h, device="cuda", generator=g) / h**0.5).to(dtype)
    w[e + 1 :] = 0
    x = torch.randn(m, h, device="cuda", generator=g).to(dtype)
    ids, weights = gemv_route_launch(x, w, e + 1, k, True, dtype)
    want = topk_route_launch(gemv(x, w)[:, : e + 1], None, k, True, 1.0, False, 1, dtype)
    assert torch.equal(ids, want[0]) and torch.equal(weights, want[1])
    assert (ids[:, k] == e).all() and not arrival._counters[x.device].any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_route_launch(x, w, e + 1, k, True, dtype)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], ids) and torch.equal(out[1], weights)
