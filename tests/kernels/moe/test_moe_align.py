"""The grouped GEMMs' rows from the Triton launches (`align_cuda`) are the tensor ops'
(`align_ref`, a stable sort by expert) bit for bit: every group in assignment order, padded to
BLOCK_M, skipped assignments (another rank's experts, ids -1 or E) last, the buffers' tail
empty. On CUDA; on CPU through Triton's interpreter in a process of its own (the interpreter is
chosen when Triton is imported)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.moe.align import align_cuda, align_ref, max_rows

CASES = [  # tokens, top k, experts, BLOCK_M
    (1, 2, 8, 16),
    (37, 4, 16, 16),
    (300, 8, 64, 64),
    (200, 10, 512, 64),  # 80B-A3B's experts
    (513, 3, 5, 128),  # groups of several blocks
    (0, 2, 8, 16),
    (32, 11, 512, 16),  # 80B-A3B's decode at batch 32 (top 10 and the shared expert): one program
    (93, 11, 64, 16),  # one program at its limit of assignments, groups of several blocks
]
# with a wider sort than the assignments': 80B-A3B's first grouped FP8 step past the skinny MoE
WIDE_CASES = [(20, 11, 513, 16, 512), (3, 2, 8, 16, 64)]


def check_align(device: str) -> int:
    """Each case against `align_ref`, int64 and int32 ids, with and without skipped ids; returns
    the number of cases checked."""
    g = torch.Generator(device=device).manual_seed(0)
    cases = 0
    for t, k, e, bm, lanes in [(*case, 16) for case in CASES] + WIDE_CASES:
        for skip in (False, True):
            ids = torch.randint(0, e, (t, k), generator=g, device=device)
            if skip:
                ids[::3, 0] = -1
                ids[1::4, -1] = e
            for dtype in (torch.int64, torch.int32):
                rows, blocks = align_cuda(ids.to(dtype), e, bm, lanes)
                want_rows, want_blocks = align_ref(ids.to(dtype), e, bm)
                assert rows.shape == (max_rows(t * k, e, bm),)
                assert torch.equal(rows, want_rows), (t, k, e, bm, skip, dtype)
                assert torch.equal(blocks, want_blocks), (t, k, e, bm, skip, dtype)
                cases += 1
    return cases


def test_align_ref_groups_rows_by_expert():
    """The oracle itself: each expert's rows in assignment order from a block boundary, padding
    rows hold the assignment count, skipped ids form the last group."""
    ids = torch.tensor([[2, 0], [2, -1], [0, 3]])  # 3 = E: skipped, like -1
    rows, blocks = align_ref(ids, 3, 4)
    n = 6
    assert rows[:12].tolist() == [1, 4, n, n, 0, 2, n, n, 3, 5, n, n]
    assert blocks[:3].tolist() == [0, 2, 3]  # expert 1 has no rows, hence no block
    assert (rows[12:] == n).all() and (blocks[3:] == 4).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_align_on_cuda():
    assert check_align("cuda") == 4 * (len(CASES) + len(WIDE_CASES))


@pytest.mark.slow
def test_align_interpreted(run_interpreted):
    assert int(run_interpreted(__file__, "t.check_align('cpu')")) == 4 * (len(CASES) + len(WIDE_CASES))
