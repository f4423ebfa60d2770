"""The torch references held to transformers' own torch functions for the same ops."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from deltaserve.kernels.attention import store_kv
from deltaserve.kernels.attention.reference import paged_attention_ref
from deltaserve.kernels.conv import conv_decode, conv_prefill
from deltaserve.kernels.conv.reference import causal_conv1d_ref
from deltaserve.kernels.gdn import gdn_decode, gdn_prefill
from deltaserve.kernels.gdn.reference import chunk_gated_delta_rule_ref


def gdn_inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=g)
    k = torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    gate = -torch.rand(t, hv, generator=g) * 2
    beta = torch.rand(t, hv, generator=g)
    return q, k, v, gate, beta


@pytest.mark.parametrize("t", [1, 5, 64, 65, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_gdn_matches_transformers(t, with_state):
    q, k, v, g, beta = gdn_inputs(t)
    init = torch.randn(4, 8, 6) if with_state else None
    ours, ours_state = chunk_gated_delta_rule_ref(q, k, v, g, beta, init)
    ref, ref_state = hf.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g=g[None],
        beta=beta[None],
        initial_state=None if init is None else init[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(ours, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, ref_state[0], atol=1e-5, rtol=1e-5)


def test_gdn_decode_matches_transformers_recurrent_step():
    q, k, v, g, beta = gdn_inputs(3, seed=1)  # three sequences, one token each
    pool = torch.randn(6, 4, 8, 6)
    slots = torch.tensor([4, 1, 2])
    before = pool.clone()
    out = gdn_decode(q, k, v, g, beta, pool, slots)
    for i, s in enumerate(slots.tolist()):
        ref, ref_state = hf.torch_recurrent_gated_delta_rule(
            q[i : i + 1, None],
            k[i : i + 1, None],
            v[i : i + 1, None],
            g=g[i : i + 1, None],
            beta=beta[i : i + 1, None],
            initial_state=before[s : s + 1],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[i], ref[0, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[s], ref_state[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[[0, 3, 5]], before[[0, 3, 5]])  # slots not addressed are untouched


def test_gdn_prefill_varlen_equals_one_sequence_at_a_time():
    lens = [3, 70, 1]
    q, k, v, g, beta = gdn_inputs(sum(lens), seed=2)
    cu = torch.tensor([0, 3, 73, 74])
    pool = torch.randn(5, 4, 8, 6)
    init = pool.clone()
    has_init = torch.tensor([True, False, True])
    slots = torch.tensor([2, 3, 1])
    out = gdn_prefill(q, k, v, g, beta, cu, pool, slots, has_init)
    for i in range(3):
        lo, hi = cu[i].item(), cu[i + 1].item()
        s = slots[i].item()
        ref, ref_state = chunk_gated_delta_rule_ref(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], init[s] if has_init[i] else None
        )
        torch.testing.assert_close(out[lo:hi], ref)
        torch.testing.assert_close(pool[s], ref_state)


@pytest.mark.parametrize("t", [1, 3, 10])
def test_causal_conv_matches_transformers(t):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 12, generator=g)
    w = torch.randn(12, 4, generator=g)
    y, final = causal_conv1d_ref(x, w, None, None, "silu")
    ref = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    torch.testing.assert_close(y, ref)
    padded = torch.cat([torch.zeros(12, 3), x.t()], dim=-1)
    torch.testing.assert_close(final, padded[:, -3:])


def test_conv_prefill_then_decode_equals_whole_sequence():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 12, generator=g)
    w = torch.randn(12, 4, generator=g)
    whole, _ = causal_conv1d_ref(x, w, None, None, "silu")
    pool = torch.randn(3, 12, 3)
    slot = torch.tensor([2])
    first = conv_prefill(x[:5], pool, w, None, torch.tensor([0, 5]), slot, torch.tensor([False]), "silu")
    second = conv_prefill(x[5:8], pool, w, None, torch.tensor([0, 3]), slot, torch.tensor([True]), "silu")
    last = conv_decode(x[8:9], pool, w, None, slot, "silu")
    torch.testing.assert_close(torch.cat([first, second, last]), whole, atol=1e-6, rtol=1e-5)
    # transformers' own one-token update on the same history
    state = torch.cat([torch.zeros(1, 12, 1), x[4:8].t()[None]], dim=-1)
    ref = hf.causal_conv1d_update(x[8:9].t()[None], state, w, None, "silu")
    torch.testing.assert_close(last, ref[0].t(), atol=1e-6, rtol=1e-5)


def test_paged_attention_matches_dense_causal_attention():
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, page = 4, 2, 16, 4
    lens, new = [10, 1, 7], [3, 1, 7]  # a cached prefix of 7, a fresh single token, a fresh prompt
    kc = torch.zeros(20, page, hkv, d)
    vc = torch.zeros(20, page, hkv, d)
    pages = [[5, 2, 9], [7], [11, 3]]
    keys = [torch.randn(n, hkv, d, generator=g) for n in lens]
    vals = [torch.randn(n, hkv, d, generator=g) for n in lens]
    for pg, kk, vv in zip(pages, keys, vals):
        slots = torch.tensor([pg[p // page] * page + p % page for p in range(kk.shape[0])])
        store_kv(kc, vc, kk, vv, slots)
    q = torch.randn(sum(new), hq, d, generator=g)
    table = torch.tensor([p + [0] * (3 - len(p)) for p in pages], dtype=torch.int32)
    cu = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    out = paged_attention_ref(q, kc, vc, table, cu, torch.tensor(lens), d**-0.5)
    for i in range(3):
        qi = q[cu[i] : cu[i + 1]].transpose(0, 1)[None]
        ki = keys[i].repeat_interleave(2, dim=1).transpose(0, 1)[None]
        vi = vals[i].repeat_interleave(2, dim=1).transpose(0, 1)[None]
        mask = torch.ones(new[i], lens[i], dtype=torch.bool).tril(lens[i] - new[i])
        ref = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
