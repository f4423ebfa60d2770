"""The Triton MLA decode kernel against the expanded torch reference."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.mla.cuda import mla_decode_triton
from deltaserve.kernels.mla.reference import mla_attention_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1, 7, 33], [300, 1, 2049], [0, 5]])
def test_triton_mla_decode_matches_expanded_reference(dtype, lens):
    """Kimi-Linear's shapes: 32 heads, nope 128 / rope 64 / v 128, kv_lora_rank 512, page 16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, nope, rope, latent, v_dim, page = 32, 128, 64, 512, 128, 16
    n = len(lens)
    max_pages = max(lens) // page + 1
    pool_pages = n * max_pages + 1
    cache = torch.randn(pool_pages, page, latent + rope, device="cuda", generator=g).to(dtype)
    table = (
        (torch.randperm(pool_pages - 1, device="cuda", generator=g)[: n * max_pages] + 1).view(n, -1).int()
    )
    q = torch.randn(n, heads, nope + rope, device="cuda", generator=g).to(dtype)
    w = (torch.randn(heads * (nope + v_dim), latent, device="cuda", generator=g) / latent**0.5).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = mla_decode_triton(q, cache, w, table, seq, (nope + rope) ** -0.5, v_dim)
    live = [i for i, s in enumerate(lens) if s > 0]
    ref = mla_attention_ref(
        q[live].float(), cache.float(), w.float(), table[live],
        torch.arange(len(live) + 1, dtype=torch.int32, device="cuda"), seq[live], (nope + rope) ** -0.5, v_dim,
    )  # fmt: skip
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out[live].float(), ref, atol=tol, rtol=tol)
    assert torch.isfinite(out).all()  # padding rows too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_attention_prefill_matches_expanded_reference(dtype):
    """The opt-in MLA prefill through torch's fused attention, Kimi-Linear's shapes: a fresh
    prompt, one continued over a cached prefix, and a decode row."""
    from deltaserve.kernels.mla.cuda import mla_prefill_sdpa

    g = torch.Generator(device="cuda").manual_seed(1)
    heads, nope, rope, latent, v_dim, page = 32, 128, 64, 512, 128, 16
    seq_lens, q_lens = [700, 1200, 33], [700, 300, 1]
    max_pages = max(seq_lens) // page + 1
    pool_pages = len(seq_lens) * max_pages + 1
    cache = torch.randn(pool_pages, page, latent + rope, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(pool_pages - 1, device="cuda", generator=g) + 1
    table = perm[: len(seq_lens) * max_pages].view(len(seq_lens), -1).int()
    q = torch.randn(sum(q_lens), heads, nope + rope, device="cuda", generator=g).to(dtype)
    w = (torch.randn(heads * (nope + v_dim), latent, device="cuda", generator=g) / latent**0.5).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = (nope + rope) ** -0.5
    out = mla_prefill_sdpa(q, cache, w, table, cu, seq, scale, v_dim)
    ref = mla_attention_ref(q.float(), cache.float(), w.float(), table, cu, seq, scale, v_dim)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("host_requests", [True, False])
def test_mixed_batch_decode_rows_take_the_decode_kernel_and_match_the_reference(host_requests):
    """A mixed step's layout (decode rows first, then a fresh prompt and one continued over a
    cached prefix) through the fused-attention prefill with `num_decodes`: the decode rows go
    to the Triton kernel in one launch, the others to the loop; all match the reference."""
    from deltaserve.kernels.mla import mla_attention

    g = torch.Generator(device="cuda").manual_seed(2)
    heads, nope, rope, latent, v_dim, page = 32, 128, 64, 512, 128, 16
    seq_lens, q_lens, decodes = [33, 1, 500, 400, 900], [1, 1, 1, 400, 200], 3
    max_pages = max(seq_lens) // page + 1
    pool_pages = len(seq_lens) * max_pages + 1
    cache = torch.randn(pool_pages, page, latent + rope, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(pool_pages - 1, device="cuda", generator=g) + 1
    table = perm[: len(seq_lens) * max_pages].view(len(seq_lens), -1).int()
    q = torch.randn(sum(q_lens), heads, nope + rope, device="cuda", generator=g).bfloat16()
    w = (torch.randn(heads * (nope + v_dim), latent, device="cuda", generator=g) / latent**0.5).bfloat16()
    bounds = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    requests = [(i, bounds[i], bounds[i + 1], seq_lens[i]) for i in range(decodes, len(seq_lens))]
    scale = (nope + rope) ** -0.5
    out = mla_attention(
        q, cache, w, table, cu, seq, scale, v_dim, decodes, requests if host_requests else None
    )
    ref = mla_attention_ref(q.float(), cache.float(), w.float(), table, cu, seq, scale, v_dim)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
