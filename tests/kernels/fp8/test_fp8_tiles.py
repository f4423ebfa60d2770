"""The FP8 GEMM's choice of tiles and K split (`kernels/fp8/cuda.py`'s `gemm_tiles`), on the CPU."""

from __future__ import annotations

import pytest

from deltaserve.kernels.fp8.blocks import num_blocks
from deltaserve.kernels.fp8.cuda import gemm_tiles

SMS = 132


@pytest.mark.parametrize("n", [1, 64, 512, 2048, 4096, 8447, 8448, 24576])
@pytest.mark.parametrize("k", [128, 300, 2048, 4096, 12288])
def test_decode_rows_split_k_only_where_tiles_are_few(n: int, k: int) -> None:
    """Decode's rows split K in powers of two, each part two 128-column blocks or more, until the
    tiles fill the SMs; a weight with two 32-row tiles an SM keeps one part; prefill never splits."""
    for m in (1, 16):
        block_n, _, split = gemm_tiles(m, n, k, SMS)
        tiles = -(-n // block_n)
        assert split & (split - 1) == 0
        assert split == 1 or num_blocks(k) >= 2 * split
        assert tiles * split >= SMS or 2 * (2 * split) > num_blocks(k)  # it stopped for a reason
        if -(-n // 32) >= 2 * SMS:
            assert (block_n, split) == (32, 1)
    assert gemm_tiles(17, n, k, SMS)[2] == 1
