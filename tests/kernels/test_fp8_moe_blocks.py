"""The skinny FP8 MoE over each expert's blocks of assignments (an expert that several tokens
chose is read once for up to 16 of them) gives bit for bit what its per-assignment form computes."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.fp8.blocks import quantize_blocks

# (tokens, experts, top k): blocks of 16 and what is left (40 tokens on 8 experts), a few
# assignments an expert, more experts chosen than tokens
CASES = [(40, 8, 2), (24, 64, 11), (3, 4, 3)]


def check_blocks(device: str, cases: list[tuple[int, int, int]] = CASES) -> int:
    """Each case at an H split of one and two, over blocks against per assignment, another rank's
    experts (ids -1 and E, in one token too) skipped alike; how many matched bit for bit (an
    assertion fails otherwise)."""
    from deltaserve.kernels.common.arrival import _counters
    from deltaserve.kernels.fp8.cuda import fp8_moe_skinny_cuda

    h, inter = 256, 256
    matched = 0
    for t, e, top_k in cases:
        g = torch.Generator(device=device).manual_seed(t + e)
        gu, gu_s = quantize_blocks(torch.randn(e, 2 * inter, h, device=device, generator=g) / h**0.5)
        dn, dn_s = quantize_blocks(torch.randn(e, h, inter, device=device, generator=g) / inter**0.5)
        x = torch.randn(t, h, device=device, generator=g).to(torch.bfloat16)
        weights, ids = torch.softmax(torch.randn(t, e, device=device, generator=g), -1).topk(top_k, dim=-1)
        weights = weights.to(torch.bfloat16)
        ids[::5, 0] = -1
        ids[1, -1] = e
        ids[0, -1] = e  # token 0 has two skipped assignments: one block holds it twice
        mine = ids[(ids >= 0) & (ids < e)]
        assert mine.bincount().max() > 1  # some expert's block holds several tokens
        for split in (1, 2):
            args = (x, gu, gu_s, dn, dn_s, 128, ids, weights, (split, 3, 64, 4))
            blocks = fp8_moe_skinny_cuda(*args, blocks=True)
            single = fp8_moe_skinny_cuda(*args)
            assert torch.equal(blocks, single), (t, e, top_k, split)
            assert blocks.abs().sum() > 0
            assert not _counters[x.device].any()  # every tile's count set back
            matched += 1
    return matched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_blocks_on_cuda():
    assert check_blocks("cuda") == 2 * len(CASES)


@pytest.mark.slow
def test_blocks_interpreted(run_interpreted):
    # the two smaller cases: the interpreter takes minutes over the 264 assignments of the other
    assert int(run_interpreted(__file__, "t.check_blocks('cpu', t.CASES[::2])")) == 4
