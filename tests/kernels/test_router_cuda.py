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
