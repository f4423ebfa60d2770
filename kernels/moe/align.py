"""The grouped GEMMs' rows: (token, k) assignments grouped by expert, each group padded to BLOCK_M.

`align_ref` builds them with tensor ops (a stable sort by expert and a dozen small launches, each
with the host's cost of a torch op: at prefill their host time a MoE layer outweighs their GPU
time); `align_cuda` with four Triton launches over chunks of 128 assignments and over experts:
each chunk's count of each expert, those counts' prefix over the chunks, each expert's group
(its start after the padded groups before it, its padding and blocks), then each chunk's rows,
each after its group's rows from earlier chunks and earlier in its chunk (the sort's stable
order). The work is linear in the assignments. Decode's few assignments take one launch of one
program instead of the four (`_align_one_kernel`). All give the same rows bit for bit, with no
host synchronisation, so CUDA graphs can capture any.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import pdl_args, wait_inputs


def max_rows(assignments: int, num_experts: int, block_m: int) -> int:
    """The rows' fixed worst-case size: every group (the skipped one too) padded by up to block_m - 1."""
    rows = assignments + (num_experts + 1) * (block_m - 1)
    return (rows + block_m - 1) // block_m * block_m


def align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert, each group padded to block_m, in buffers of a fixed worst-case size.

    Returns (rows [R], block_expert [R // block_m]); padding rows hold num_assign. Assignments
    whose id is outside [0, num_experts) (skipped: another rank's expert) form one last group
    whose blocks hold num_experts, as empty blocks do (num_experts or num_experts + 1): the
    GEMMs pass over every block of an expert >= num_experts, the down kernel writes zeros for
    the skipped rows.
    """
    flat = topk_ids.reshape(-1).long()
    flat = flat.masked_fill((flat < 0) | (flat >= num_experts), num_experts)
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.sort(flat, stable=True).indices
    sorted_expert = flat[order]
    rank = torch.arange(n, device=device) - count_start[sorted_expert]
    total = max_rows(n, num_experts, block_m)
    rows = torch.full((total,), n, dtype=torch.int32, device=device)
    rows.scatter_(0, padded_start[sorted_expert] + rank, order.to(torch.int32))
    block_start = torch.arange(0, total, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return rows, block_expert


@triton.jit
def _experts_of(ids, c, N, E, CHUNK: tl.constexpr):
    """Chunk c's assignments: their offsets, experts (skipped ones, outside [0, E), as E; past N
    as E + 1, a bin nothing reads) and which are live."""
    offs = c * CHUNK + tl.arange(0, CHUNK)
    live = offs < N
    v = tl.load(ids + offs, mask=live, other=0).to(tl.int32)
    return offs, tl.where(live, tl.where((v < 0) | (v >= E), E, v), E + 1), live


# N and C follow the step's tokens and bound masks only: one compile for every step size
@triton.jit(do_not_specialize=["N"])
def _chunk_count_kernel(ids, counts, N, E, EB: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    _, v, _ = _experts_of(ids, c, N, E, CHUNK)
    tl.store(counts + c * EB + tl.arange(0, EB), tl.histogram(v, EB))


@triton.jit(do_not_specialize=["C"])
def _chunk_prefix_kernel(counts, totals, C, EB: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr):
    """Each expert's count in the chunks before each chunk (in place of the chunk's own), and its total."""
    oe = tl.program_id(0) * COLS + tl.arange(0, COLS)
    carry = tl.zeros([COLS], tl.int32)
    for c0 in range(0, C, ROWS):
        oc = c0 + tl.arange(0, ROWS)
        ptrs = counts + oc[:, None] * EB + oe[None, :]
        tile = tl.load(ptrs, mask=(oc < C)[:, None], other=0)
        tl.store(ptrs, tl.cumsum(tile, 0) - tile + carry[None, :], mask=(oc < C)[:, None])
        carry += tl.sum(tile, 0)
    tl.store(totals + oe, carry)


@triton.jit(do_not_specialize=["N"])
def _groups_kernel(totals, starts, rows, block_expert, N, E, R, BLOCK_M: tl.constexpr, EB: tl.constexpr):
    """Expert e's group: where it starts (after the padded groups before it), its padding rows and
    its blocks; the last group's program also empties the buffers' tail."""
    e = tl.program_id(0)
    oe = tl.arange(0, EB)
    padded_all = (tl.load(totals + oe, mask=oe <= E, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(oe < e, padded_all, 0), 0)
    count = tl.load(totals + e)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(starts + e, start)
    om = tl.arange(0, BLOCK_M)
    tl.store(rows + start + count + om, tl.zeros([BLOCK_M], tl.int32) + N, mask=count + om < padded)
    ob = tl.arange(0, 1024)
    for j0 in range(0, padded // BLOCK_M, 1024):
        keep = j0 + ob < padded // BLOCK_M
        tl.store(block_expert + start // BLOCK_M + j0 + ob, tl.zeros([1024], tl.int32) + e, mask=keep)
    if e == E:
        end = start + padded
        for j0 in range(end, R, 1024):
            tl.store(rows + j0 + ob, tl.zeros([1024], tl.int32) + N, mask=j0 + ob < R)
        for j0 in range(end // BLOCK_M, R // BLOCK_M, 1024):
            tl.store(block_expert + j0 + ob, tl.zeros([1024], tl.int32) + E + 1, mask=j0 + ob < R // BLOCK_M)


@triton.jit(do_not_specialize=["N"])
def _place_kernel(ids, counts, starts, rows, N, E, EB: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk c's assignments at their group's start, after the group's rows from earlier chunks
    and those before them in this chunk: the assignment order within each group."""
    c = tl.program_id(0)
    offs, v, live = _experts_of(ids, c, N, E, CHUNK)
    o = tl.arange(0, CHUNK)
    earlier = tl.sum(((v[:, None] == v[None, :]) & (o[None, :] < o[:, None])).to(tl.int32), 1)
    pos = tl.load(starts + v, mask=live, other=0) + tl.load(counts + c * EB + v, mask=live, other=0) + earlier
    tl.store(rows + pos, offs.to(tl.int32), mask=live)


@triton.jit(do_not_specialize=["N"])
def _align_one_kernel(
    ids, shift, marks, rows, block_expert, N, E, R,
    BLOCK_M: tl.constexpr, EB: tl.constexpr, NB: tl.constexpr, BB: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """All of `align_cuda` in one program, for decode's few assignments: the assignments sorted by
    (expert, index), each placed at its group's start plus its rank in the sorted order less the
    group's first; each block's expert the last group starting at or before it (a running max of
    the groups' first blocks). Global scratch carries per-expert and per-block values between
    lanes, with a barrier after each write."""
    wait_inputs(PDL)
    o = tl.arange(0, NB)
    live = o < N
    v = tl.load(ids + o, mask=live, other=0).to(tl.int32)
    v = tl.where(live, tl.where((v < 0) | (v >= E), E, v), E + 1)
    oe = tl.arange(0, EB)
    counts = tl.where(oe <= E, tl.histogram(v, EB), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, 0) - padded
    # rank j in the sorted order lands at starts[v] + j - (assignments before v's group)
    tl.store(shift + oe, starts - (tl.cumsum(counts, 0) - counts))
    ob = tl.arange(0, BB)
    tl.store(marks + ob, tl.zeros([BB], tl.int32))
    for j0 in range(0, R, NB):
        tl.store(rows + j0 + o, tl.zeros([NB], tl.int32) + N, mask=j0 + o < R)
    tl.debug_barrier()
    end = tl.sum(padded, 0)
    tl.store(marks + starts // BLOCK_M, oe, mask=padded > 0)
    tail = end // BLOCK_M + ob
    tl.store(marks + tail, tl.zeros([BB], tl.int32) + E + 1, mask=(ob == 0) & (tail < R // BLOCK_M))
    key = tl.sort(v * NB + o)
    sv = key // NB
    tl.store(rows + tl.load(shift + sv) + o, key % NB, mask=sv <= E)
    tl.debug_barrier()
    blocks = tl.associative_scan(tl.load(marks + ob), 0, _max_combine)
    tl.store(block_expert + ob, blocks, mask=ob < R // BLOCK_M)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


ONE_PROGRAM_ASSIGNMENTS = 1024  # up to this many (decode's), one launch in one program
ONE_PROGRAM_BINS = 1024  # experts (+ 2) and blocks that one program's lanes hold
ONE_PROGRAM_WARPS = 4  # the fastest of 1-16 at 24-64 tokens of 80B's experts (`bench/ops/moe_align.py`)


def align_cuda(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, min_lanes: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_ref`'s rows and block experts from four launches: each chunk's count of each expert,
    their prefix over chunks, each group's start, padding and blocks, then each chunk's rows. Up to
    `ONE_PROGRAM_ASSIGNMENTS`, from one launch of one program (`_align_one_kernel`), whose sort is
    as wide as the assignments' next power of two and `min_lanes` (a power of two) at least."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    total = max_rows(n, num_experts, block_m)
    chunk, cols = 128, 16
    eb = max(triton.next_power_of_2(num_experts + 2), cols)  # E + 1 holds the last chunk's dead lanes
    device = flat.device
    rows = torch.empty(total, dtype=torch.int32, device=device)
    block_expert = torch.empty(total // block_m, dtype=torch.int32, device=device)
    nb = max(triton.next_power_of_2(n), min_lanes, 16)
    # block lanes for nb assignments, not n: a compiled kernel per sort width, not per (width, n)
    bb = triton.next_power_of_2(max_rows(nb, num_experts, block_m) // block_m)
    if n <= ONE_PROGRAM_ASSIGNMENTS and max(eb, bb) <= ONE_PROGRAM_BINS:
        shift = torch.empty(eb, dtype=torch.int32, device=device)
        marks = torch.empty(bb, dtype=torch.int32, device=device)
        _align_one_kernel[(1,)](
            flat, shift, marks, rows, block_expert, n, num_experts, total, BLOCK_M=block_m, EB=eb, NB=nb, BB=bb,
            num_warps=ONE_PROGRAM_WARPS, **pdl_args(device),
        )  # fmt: skip
        return rows, block_expert
    chunks = max(triton.cdiv(n, chunk), 1)
    counts = torch.empty(chunks, eb, dtype=torch.int32, device=device)
    totals = torch.empty(eb, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    _chunk_count_kernel[(chunks,)](flat, counts, n, num_experts, EB=eb, CHUNK=chunk, num_warps=4)
    _chunk_prefix_kernel[(eb // cols,)](counts, totals, chunks, EB=eb, COLS=cols, ROWS=64, num_warps=4)
    _groups_kernel[(num_experts + 1,)](
        totals, starts, rows, block_expert, n, num_experts, total, BLOCK_M=block_m, EB=eb, num_warps=4
    )
    _place_kernel[(chunks,)](flat, counts, starts, rows, n, num_experts, EB=eb, CHUNK=chunk, num_warps=4)
    return rows, block_expert


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
