"""The Triton MLA decode kernel against the expanded torch reference."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.mla import mla_attention_ref, mla_decode_triton

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
