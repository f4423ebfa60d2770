"""KDA and MLA torch references against transformers' own torch code for the same ops (CPU).

transformers' `chunk_kimi_delta_attention` / `recurrent_kimi_delta_attention` are the
Kimi-Linear fallbacks it runs when FLA is absent; the pool ops must agree with them per
sequence, whatever the packing, slots and initial states.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.kda import kda_decode, kda_prefill
from deltaserve.kernels.kda.reference import chunk_kda_ref, recurrent_kda_ref
from deltaserve.kernels.mla import store_latent
from deltaserve.kernels.mla.cuda import mla_prefill_sdpa
from deltaserve.kernels.mla.reference import (
    mla_attention_absorbed_ref,
    mla_attention_ref,
    mla_decode_absorbed,
)

H, K, V = 3, 16, 12


def hf():
    from transformers.models.kimi_linear import modeling_kimi_linear

    return modeling_kimi_linear


def inputs(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, H, K, generator=g), torch.randn(t, H, K, generator=g)
    v = torch.randn(t, H, V, generator=g)
    # per-channel log decays spanning slow and fast forgetting
    gate = -torch.rand(t, H, K, generator=g) * torch.logspace(-2, 0.5, K)
    beta = torch.rand(t, H, generator=g)
    return q, k, v, gate, beta


def hf_chunk(q, k, v, gate, beta, init):
    o, s = hf().chunk_kimi_delta_attention(
        q[None], k[None], v[None], gate[None], beta[None],
        initial_state=None if init is None else init[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return o[0], s[0]


@pytest.mark.parametrize("t", [1, 17, 64, 65, 150])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunk_matches_transformers(t, with_init):
    q, k, v, gate, beta = inputs(t, seed=t)
    init = torch.randn(H, K, V) if with_init else None
    o, s = chunk_kda_ref(q, k, v, gate, beta, init)
    ho, hs = hf_chunk(q, k, v, gate, beta, init)
    torch.testing.assert_close(o, ho, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, hs, rtol=1e-5, atol=1e-5)


def test_recurrent_matches_transformers_bit_for_bit():
    q, k, v, gate, beta = inputs(40, seed=1)
    init = torch.randn(H, K, V)
    ho, hs = hf().recurrent_kimi_delta_attention(
        q[None], k[None], v[None], gate[None], beta[None],
        initial_state=init[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    state, outs = init[None], []
    for i in range(q.shape[0]):
        o, state = recurrent_kda_ref(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], gate[i : i + 1], beta[i : i + 1], state
        )
        outs.append(o)
    assert torch.equal(torch.cat(outs), ho[0]) and torch.equal(state[0], hs[0])


@pytest.mark.slow
def test_pool_ops_match_per_sequence():
    """Varlen prefill (fresh and continued) then a decode step, on scrambled pool slots."""
    lengths, slots, has_init = [5, 64, 1, 97], [6, 2, 9, 4], [False, True, True, False]
    pool = torch.randn(10, H, K, V)
    before = pool.clone()
    q, k, v, gate, beta = inputs(sum(lengths), seed=3)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = kda_prefill(
        q, k, v, gate, beta, cu, pool, torch.tensor(slots, dtype=torch.int32), torch.tensor(has_init)
    )
    finals = []
    for i, (slot, init) in enumerate(zip(slots, has_init)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        ho, hs = hf_chunk(
            q[lo:hi], k[lo:hi], v[lo:hi], gate[lo:hi], beta[lo:hi], before[slot] if init else None
        )
        torch.testing.assert_close(out[lo:hi], ho, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], hs, rtol=1e-5, atol=1e-5)
        finals.append(hs)
    untouched = [i for i in range(10) if i not in slots]
    assert torch.equal(pool[untouched], before[untouched])

    dq, dk, dv, dg, dbeta = inputs(len(slots), seed=4)
    after_prefill = pool.clone()
    o = kda_decode(dq, dk, dv, dg, dbeta, pool, torch.tensor(slots, dtype=torch.int32))
    for i, slot in enumerate(slots):
        ho, hs = hf().recurrent_kimi_delta_attention(
            dq[None, i : i + 1], dk[None, i : i + 1], dv[None, i : i + 1], dg[None, i : i + 1],
            dbeta[None, i : i + 1], initial_state=after_prefill[slot][None], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(o[i], ho[0, 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pool[slot], hs[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[untouched], before[untouched])


def test_forget_gate_matches_transformers():
    from transformers import KimiLinearConfig

    from deltaserve.models.layers.kda import KimiDeltaAttention

    cfg = KimiLinearConfig(hidden_size=24, num_hidden_layers=1, linear_num_heads=2, linear_head_dim=8)
    torch.manual_seed(0)
    theirs = hf().KimiLinearForgetGate(cfg)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=2.0)
    ours = KimiDeltaAttention(cfg, 0)
    with torch.no_grad():
        ours.gates_a_proj.weight[: cfg.linear_head_dim].copy_(theirs.f_a_proj.weight)
        ours.f_b_proj.weight.copy_(theirs.f_b_proj.weight)
        ours.dt_bias.copy_(theirs.dt_bias)
        ours.A_log.copy_(theirs.A_log.reshape(-1))
    x = torch.randn(9, 24)
    assert torch.equal(ours.forget_gate(x), theirs(x[None])[0])


def _paged_latents(seed: int, seq_lens: list[int], q_lens: list[int], tables: list[list[int]]) -> tuple:
    """MLA attention arguments over a paged latent cache: 4 heads, nope 8, rope 6, latent 16,
    v 10, pages of 4; each request's latents stored through its page table."""
    heads, nope, rope, lora, vdim, page = 4, 8, 6, 16, 10, 4
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(heads * (nope + vdim), lora, generator=g) * 0.3
    cache = torch.zeros(16, page, lora + rope)
    for n, table in zip(seq_lens, tables):
        pos = torch.arange(n)
        slots = torch.tensor(table)[pos // page] * page + pos % page
        store_latent(cache, torch.randn(n, lora + rope, generator=g), slots)
    page_table = torch.tensor([t + [0] * (4 - len(t)) for t in tables], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, nope + rope, generator=g)
    return q, cache, w, page_table, cu, torch.tensor(seq_lens, dtype=torch.int32), 0.3, vdim


def test_mla_absorbed_matches_expanded():
    """The absorbed form (decode kernels' algebra) against the expanded oracle, paged and packed."""
    # a fresh prefill, a decode, a continued prefill
    args = _paged_latents(0, [9, 3, 14], [9, 1, 5], [[3, 7, 1], [5, 0, 0], [2, 11, 8, 10]])
    torch.testing.assert_close(
        mla_attention_absorbed_ref(*args), mla_attention_ref(*args), rtol=1e-5, atol=1e-5
    )


def test_mla_batched_decode_matches_expanded():
    """The batched absorbed decode (the CUDA decode path) against the oracle, on CPU tensors."""
    heads, nope, rope, lora, vdim, page = 4, 8, 6, 16, 10, 4
    g = torch.Generator().manual_seed(1)
    w = torch.randn(heads * (nope + vdim), lora, generator=g) * 0.3
    cache = torch.randn(12, page, lora + rope, generator=g)
    seq_lens = torch.tensor([9, 1, 14, 4], dtype=torch.int32)
    page_table = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 11, 8, 10], [6, 0, 0, 0]], dtype=torch.int32)
    q = torch.randn(4, heads, nope + rope, generator=g)
    cu = torch.arange(5, dtype=torch.int32)
    ref = mla_attention_ref(q, cache, w, page_table, cu, seq_lens, 0.3, vdim)
    out = mla_decode_absorbed(q, cache, w, page_table, seq_lens, 0.3, vdim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_mla_fused_attention_prefill_matches_expanded():
    """The opt-in fused-attention MLA prefill against the oracle: fresh prefills (plain causal),
    continued ones over a cached prefix (explicit mask), a decode row, a request without
    queries, and v narrower than the keys (zero-padded)."""
    tables = [[3, 7, 1], [5, 0, 0], [2, 11, 8, 10], [4, 12], [9, 13]]
    args = _paged_latents(2, [9, 3, 14, 6, 5], [9, 1, 5, 0, 5], tables)
    out = mla_prefill_sdpa(*args)
    torch.testing.assert_close(out, mla_attention_ref(*args), rtol=1e-5, atol=1e-5)
    q, cache, w, *rest = args
    assert not torch.allclose(mla_prefill_sdpa(q, cache, w.roll(1, 0), *rest), out)  # weights count
