"""Fast CUDA path of paged attention, on our Triton kernels (`attention/triton.py`).

Semantics and shapes are those of `deltaserve.kernels.attention`. Decode (every request has
one query token) is CUDA-graph safe: launch parameters depend on shapes only, never on lengths.
"""

from __future__ import annotations

import torch
import triton

from deltaserve.kernels.common.launch import sm_count
from deltaserve.kernels.common.pdl import pdl_args

_MAX_SPLITS = 64
# One 64-token tile per split at least: a larger minimum leaves a small batch with few KV heads
# too few programs to fill the GPU (docs/kernels.md, "Paged attention decode").
_MIN_TOKENS_PER_SPLIT = 64
# Splits the merge reads a tile, a loop over tiles taking any count: one [16, head dim] fp32 tile
# holds fewer registers than one as wide as the count (at most 64), which is masked at run time
_REDUCE_TILE = 16


def _precision(dtype: torch.dtype) -> str:
    # fp32 caches are for tests and debugging: keep them exact rather than TF32.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_splits(batch: int, kv_heads: int, max_context: int, sms: int) -> int:
    """KV splits per (request, KV head): enough programs to fill the SMs twice over, yet at
    least `_MIN_TOKENS_PER_SPLIT` tokens per split. Depends on shapes only (graph-safe)."""
    want = triton.cdiv(2 * sms, max(batch * kv_heads, 1))
    cap = triton.cdiv(max_context, _MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(want, cap, _MAX_SPLITS)))


def paged_decode_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    from deltaserve.kernels.attention.triton import _paged_decode_kernel, _paged_decode_reduce_kernel

    n = seq_lens.shape[0]
    hq, dim = q.shape[1], q.shape[2]
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if num_splits > 1:
        part_o = torch.empty(n, hq, num_splits, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(n, hq, num_splits, dtype=torch.float32, device=q.device)
    else:  # unused; fp32 as with splits, so that both run one compiled kernel
        part_o = part_lse = torch.empty(1, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(n, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        cu_seqlens_q,
        seq_lens,
        out,
        part_o,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale * 1.4426950408889634,
        num_splits,
        HQ=hq,
        GROUP=group,
        BG=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        D=dim,
        BD=triton.next_power_of_2(dim),
        PAGE=page_size,
        BN=block_n,
        PREC=_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_args(q.device),
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(n, hq)](
            cu_seqlens_q,
            out,
            part_o,
            part_lse,
            out.stride(0),
            out.stride(1),
            num_splits,
            HQ=hq,
            D=dim,
            BD=triton.next_power_of_2(dim),
            BS=_REDUCE_TILE,
            num_warps=4,
            **pdl_args(cu_seqlens_q.device),
        )


def prefill_tiles(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """`(BM, BN, num_warps, num_stages)` of the prefill kernel.

    bf16 / fp16: the fastest of a sweep at head dim 256 (`bench.ops.kernels --only paged_prefill
    --sweep`, docs/kernels.md). fp32 (tests, debugging) keeps tiles small enough for shared
    memory.
    """
    if dtype == torch.float32:
        return 32, 32, 4, 2
    return 128, 64, 8, 3


def paged_prefill_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_seqlen_q: int,
    tiles: tuple[int, int, int, int] | None = None,
) -> None:
    from deltaserve.kernels.attention.triton import _paged_prefill_kernel

    n = seq_lens.shape[0]
    hq, dim = q.shape[1], q.shape[2]
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    block_m, block_n, num_warps, num_stages = tiles or prefill_tiles(q.dtype)
    grid = (triton.cdiv(max_seqlen_q, block_m), n, hq)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        page_table,
        cu_seqlens_q,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale * 1.4426950408889634,
        GROUP=hq // hkv,
        D=dim,
        BD=triton.next_power_of_2(dim),
        PAGE=page_size,
        BM=block_m,
        BN=block_n,
        PREC=_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_args(q.device),
    )


def paged_attention_cuda(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """q `[T, Hq, D]` over N requests; returns `[T, Hq, D]` in q's dtype.

    `max_seqlen_q == 1` takes the decode kernel; None is computed here (a host sync, so
    decode callers, and CUDA graphs, must pass it).
    """
    hq, dim = q.shape[1], q.shape[2]
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    assert hq % hkv == 0 and k_cache.shape[3] == dim, (q.shape, k_cache.shape)
    assert page_size & (page_size - 1) == 0, "page size must be a power of two"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.dtype == v_cache.dtype
    out = torch.empty_like(q)
    q = q.to(k_cache.dtype)  # tl.dot wants matching operand types
    n = seq_lens.shape[0]
    if n == 0 or q.shape[0] == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if max_seqlen_q == 1:
        max_context = page_table.shape[1] * page_size
        sms = sm_count(q.device)
        splits = decode_splits(n, hkv, max_context, sms)
        # 64-token tiles keep more bytes in flight when the grid is about one wave; 32-token
        # tiles let more programs share an SM when it is many.
        few_programs = n * hkv * splits <= 2 * sms
        block_n = 64 if q.element_size() == 2 and (dim <= 128 or few_programs) else 32
        paged_decode_launch(
            q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, out, splits, block_n
        )
    else:
        paged_prefill_launch(
            q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, out, max_seqlen_q
        )
    return out
