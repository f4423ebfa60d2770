"""The one delta-rule reference behind GDN and KDA: a per-head gate is a per-channel gate with
one value across the channels, and the chunked form equals stepping token by token."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.delta_rule.reference import chunk_delta_rule_ref, recurrent_delta_rule_ref
from deltaserve.kernels.gdn.reference import l2norm

HK, H, K, V = 2, 4, 16, 8


def inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, HK, K, generator=gen) for _ in range(2))
    v = torch.randn(t, H, V, generator=gen)
    g = -torch.rand(t, H, generator=gen)  # log decay per head
    beta = torch.rand(t, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("t", [1, 37, 130])
def test_per_head_gate_equals_the_same_gate_per_channel(t):
    q, k, v, g, beta = inputs(t)
    init = torch.randn(H, K, V) * 0.1
    per_channel = g.unsqueeze(-1).expand(t, H, K)
    o_head, s_head = chunk_delta_rule_ref(q, k, v, g, beta, init, l2norm, chunk_size=16)
    o_chan, s_chan = chunk_delta_rule_ref(q, k, v, per_channel, beta, init, l2norm, chunk_size=16)
    torch.testing.assert_close(o_head, o_chan, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_head, s_chan, rtol=1e-5, atol=1e-5)
    step_head = recurrent_delta_rule_ref(q, k, v, g, beta, init.expand(t, H, K, V), l2norm)
    step_chan = recurrent_delta_rule_ref(q, k, v, per_channel, beta, init.expand(t, H, K, V), l2norm)
    assert torch.equal(step_head[0], step_chan[0]) and torch.equal(step_head[1], step_chan[1])


@pytest.mark.parametrize("per_channel", [False, True])
def test_chunked_equals_token_by_token(per_channel):
    t = 45
    q, k, v, g, beta = inputs(t, seed=1)
    if per_channel:
        g = g.unsqueeze(-1) * torch.rand(t, H, K, generator=torch.Generator().manual_seed(2))
    state = torch.randn(H, K, V) * 0.1
    out, final = chunk_delta_rule_ref(q, k, v, g, beta, state, l2norm, chunk_size=16)
    steps = []
    for i in range(t):
        o, s = recurrent_delta_rule_ref(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], state[None], l2norm
        )
        state = s[0]
        steps.append(o[0])
    torch.testing.assert_close(out, torch.stack(steps), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, state, rtol=1e-4, atol=1e-4)
