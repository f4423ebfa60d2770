"""How many Triton variants our launchers ask for as a step's sizes change: each new one is a
compile (a second or so) inside the step that first meets it. Counted on CPU from the launches'
specialization keys (`tests/triton_keys.py`, the `triton_keys` fixture) at Kimi-Linear's sizes, on `meta` tensors."""

from __future__ import annotations

import pytest
import torch

M = "meta"
HEADS, NOPE, ROPE, LATENT, V_DIM, PAGE = 32, 128, 64, 512, 128, 16


def mla_decode(n: int, max_positions: int) -> None:
    from deltaserve.kernels.mla.cuda import mla_decode_triton

    pages = -(-max_positions // PAGE)
    mla_decode_triton(
        torch.empty(n, HEADS, NOPE + ROPE, device=M, dtype=torch.bfloat16),
        torch.empty(4096, PAGE, LATENT + ROPE, device=M, dtype=torch.bfloat16),
        torch.empty(HEADS * (NOPE + V_DIM), LATENT, device=M, dtype=torch.bfloat16),
        torch.zeros(n, pages, device=M, dtype=torch.int32),
        torch.zeros(n, device=M, dtype=torch.int32),
        (NOPE + ROPE) ** -0.5,
        V_DIM,
    )


def test_mla_decode_compiles_once_for_every_batch_and_context(triton_keys) -> None:
    """A mixed step's decode rows (1 to 256 of them, beside prompts up to 32k positions) split
    their positions differently (`mla.cuda._num_splits`) and read a page table as wide as the
    longest context: the kernel takes both at run time, so all of them run one compiled kernel."""
    with triton_keys.recorded_launches() as launches:
        for n in (1, 2, 3, 5, 7, 9, 16, 33, 45, 67, 200, 256):
            for positions in (16, 300, 1024, 1300, 2049, 8192, 32768):
                mla_decode(n, positions)
    assert len(launches) == 12 * 7
    assert len(triton_keys.variants(launches)["_mla_decode_kernel"]) == 1


def check_mla_decode(device: str) -> int:
    """The decode kernel against the expanded reference with one, eight and 19 splits of the
    positions; returns the number of cases checked."""
    from deltaserve.kernels.mla.cuda import _num_splits, mla_decode_triton
    from deltaserve.kernels.mla.reference import mla_attention_ref

    g = torch.Generator(device=device).manual_seed(0)
    cases = 0
    for lens, splits in (([1, 7, 33], 1), ([300, 1, 2049], 8), ([5000, 40, 3, 9, 1, 700], 19)):
        n = len(lens)
        max_pages = max(lens) // PAGE + 1
        assert _num_splits(n * 2, max_pages * PAGE, torch.device(device)) == splits
        pool = n * max_pages + 1
        cache = torch.randn(pool, PAGE, LATENT + ROPE, device=device, generator=g)
        table = (torch.randperm(pool - 1, device=device, generator=g)[: n * max_pages] + 1).view(n, -1).int()
        q = torch.randn(n, HEADS, NOPE + ROPE, device=device, generator=g)
        w = torch.randn(HEADS * (NOPE + V_DIM), LATENT, device=device, generator=g) / LATENT**0.5
        seq = torch.tensor(lens, dtype=torch.int32, device=device)
        scale = (NOPE + ROPE) ** -0.5
        out = mla_decode_triton(q, cache, w, table, seq, scale, V_DIM)
        cu = torch.arange(n + 1, dtype=torch.int32, device=device)
        ref = mla_attention_ref(q, cache, w, table, cu, seq, scale, V_DIM)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        cases += 1
    return cases


@pytest.mark.slow
def test_mla_decode_interpreted(run_interpreted) -> None:
    assert int(run_interpreted(__file__, "t.check_mla_decode('cpu')")) == 3
