"""The MoE reference with skipped assignments (ids outside [0, E): another expert-parallel
rank's experts): they add exactly nothing, and the ranks' sums make the whole MoE."""

from __future__ import annotations

import torch

from deltaserve.kernels.moe.reference import moe_ref


def _inputs(t: int, e: int, k: int, h: int = 16, i: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w1 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, w1, w2, ids, torch.rand(t, k, generator=g)


def test_skipped_ids_add_exactly_nothing():
    """-1 and E both skip: the result is bit for bit the one where those assignments go to an
    extra all-zero expert (whose output is exactly zero), whatever their weights."""
    x, w1, w2, ids, wts = _inputs(12, 4, 2)
    skipped = ids.clone()
    skipped[::3, 0] = -1
    skipped[1::4, 1] = 4
    zero_expert = (
        torch.cat([w1, w1.new_zeros(1, *w1.shape[1:])]),
        torch.cat([w2, w2.new_zeros(1, *w2.shape[1:])]),
    )
    to_zero = skipped.masked_fill((skipped < 0) | (skipped >= 4), 4)
    expected = moe_ref(x, *zero_expert, to_zero, wts)
    torch.testing.assert_close(moe_ref(x, w1, w2, skipped, wts), expected, rtol=0, atol=0)
    assert not torch.equal(expected, moe_ref(x, w1, w2, ids, wts))  # the skips did change it
    assert torch.equal(moe_ref(x, w1, w2, torch.full_like(ids, -1), wts), torch.zeros_like(x))


def test_expert_blocks_sum_to_the_whole_moe():
    """Two ranks with experts [0, 4) and [4, 8), each its ids remapped (others -1): the sum of
    their outputs is the MoE over all eight experts."""
    x, w1, w2, ids, wts = _inputs(20, 8, 3, seed=1)
    total = torch.zeros_like(x)
    for first in (0, 4):
        local = ids - first
        local = local.masked_fill((local < 0) | (local >= 4), -1)
        total += moe_ref(x, w1[first : first + 4], w2[first : first + 4], local, wts)
    torch.testing.assert_close(total, moe_ref(x, w1, w2, ids, wts), rtol=1e-6, atol=1e-6)
