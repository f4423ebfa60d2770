"""A step's batch: FLA's chunk indices for the prefill rows are built on the host, equal to FLA's."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve.engine.runner.forward_batch import FLA_CHUNK, build_forward_batch, fla_chunk_indices


def chunk_pairs(lengths: list[int], chunk: int) -> list[tuple[int, int]]:
    """The definition: every `chunk`-token chunk of sequence i, in order, as (i, its index)."""
    return [(i, c) for i, n in enumerate(lengths) for c in range(-(-n // chunk))]


@pytest.mark.parametrize("seed", range(20))
def test_host_chunk_indices_follow_the_definition(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.choice([1, 63, 64, 65, 128, rng.randint(1, 700)]) for _ in range(rng.randint(1, 12))]
    flat = fla_chunk_indices(lengths, FLA_CHUNK)
    assert list(zip(flat[0::2], flat[1::2])) == chunk_pairs(lengths, FLA_CHUNK)


def test_batch_carries_them_for_prefill_rows_only() -> None:
    prefill = [list(range(10, 10 + n)) for n in (70, 5, 130)]
    batch = build_forward_batch(
        token_lists=[[1], [2], *prefill],
        starts=[40, 7, 0, 0, 0],
        pages=[[1, 2, 3], [4], [5, 6, 7, 8, 9], [10], [11, 12, 13, 14, 15, 16, 17, 18, 19]],
        slots=[1, 2, 3, 4, 5],
        has_initial=[True, True, False, False, False],
        sample_mask=[True] * 5,
        num_decodes=2,
        page_size=16,
        device=torch.device("cpu"),
    )
    assert batch.prefill_chunk_indices is not None
    got = [tuple(r) for r in batch.prefill_chunk_indices.tolist()]
    assert got == chunk_pairs([70, 5, 130], FLA_CHUNK)
    decodes_only = build_forward_batch(
        [[1], [2]], [40, 7], [[1, 2, 3], [4]], [1, 2], [True, True], [True, True], 2, 16, torch.device("cpu")
    )
    assert decodes_only.prefill_chunk_indices is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_equal_to_flas_own_builder() -> None:
    from fla.ops.utils.index import prepare_chunk_indices

    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.randint(1, 900) for _ in range(rng.randint(1, 16))]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
        ours = torch.tensor(fla_chunk_indices(lengths, FLA_CHUNK), device="cuda").view(-1, 2)
        assert torch.equal(ours, prepare_chunk_indices(cu, FLA_CHUNK))


@pytest.mark.parametrize("seed", range(5))
def test_host_request_bounds_equal_the_device_tensors(seed: int) -> None:
    """MLA's prefill loop takes each non-decode request's rows and KV length from the host's lists;
    they must be what the batch's cu_seqlens_q and seq_lens say."""
    from deltaserve.engine.runner.attention_backend import AttentionMetadata
    from deltaserve.kernels.mla.reference import _requests

    rng = random.Random(seed)
    decodes, verify, prefill = rng.randint(0, 6), rng.randint(0, 2), rng.randint(1, 4)
    lens = [1] * decodes + [3] * verify + [rng.randint(1, 300) for _ in range(prefill)]
    starts = [rng.randint(0, 200) for _ in lens]
    page = 16
    pages = [
        list(range(1 + 40 * i, 1 + 40 * i + (s + n) // page + 1))
        for i, (s, n) in enumerate(zip(starts, lens))
    ]
    batch = build_forward_batch(
        [list(range(5, 5 + n)) for n in lens], starts, pages, list(range(len(lens))), [s > 0 for s in starts],
        [True] * len(lens), decodes, page, torch.device("cpu"), num_verify=verify,
    )  # fmt: skip
    meta = AttentionMetadata(
        batch.slot_mapping, batch.page_table, batch.cu_seqlens_q, batch.seq_lens, batch.max_seqlen_q,
        batch.num_decodes, batch.source,
    )  # fmt: skip
    expected = _requests(batch.cu_seqlens_q, batch.seq_lens, decodes)
    assert meta.requests == expected
    assert [r[2] - r[1] for r in expected] == lens[decodes:]
