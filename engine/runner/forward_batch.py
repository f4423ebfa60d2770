"""One step's batch, as tensors on the model's device.

Requests are ordered decodes first: the first `num_decodes` each bring one token and
continue from a state already in their slot; then speculative verification windows (the
last token and its drafts, continuing a state, every position sampled); the rest are
prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltaserve.engine.runner.h2d import to_device_packed
from deltaserve.models.forward import ImageEmbeds

# chunks longer than this compute their KV slots with numpy: a per-token Python loop over a
# long prefill is a visible share of the host's step
_VECTOR_ROWS = 64
FLA_CHUNK = 64  # the chunk length of FLA's chunked delta-rule kernels


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], or [3, T] with image tokens in the step (models/vision/positions.py)
    num_decodes: int
    max_seqlen_q: int
    cu_seqlens_q: torch.Tensor  # [N+1] int32
    seq_lens: torch.Tensor  # [N] int32, KV length once this step's tokens are in
    page_table: torch.Tensor | None  # [N, max_pages] int32; None: the attention backend's slot table
    slot_mapping: torch.Tensor  # [T] int64, flat KV position of each new token
    state_slots: torch.Tensor  # [N] int32
    has_initial_state: torch.Tensor  # [N] bool
    logits_indices: torch.Tensor  # [M] token index of each sampled position
    verify_lens: list[int] = field(default_factory=list)  # tokens of each verification window
    page_columns: int = 0  # the most pages any request of the batch has
    # prefill rows' FLA chunk indices [chunks, 2] (sequence, chunk within it), built on the host:
    # FLA's own builder reads lengths back from the device, a sync that stalls overlap scheduling
    prefill_chunk_indices: torch.Tensor | None = None
    # logits rows after the sampled ones: prompt positions whose log-probabilities were asked for
    num_prompt_logits: int = 0
    # build_forward_batch's arguments less the device: tensor-parallel workers rebuild the batch
    source: dict[str, Any] | None = None
    # input ids filled on the device from the previous step's samples (overlap scheduling):
    # tensor-parallel workers receive them by broadcast
    inputs_on_device: bool = False
    # image tokens: (their rows in the batch, the vision tower's embeddings for them)
    image_embeds: ImageEmbeds | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])


def build_forward_batch(
    token_lists: list[list[int]],
    starts: list[int],
    pages: list[list[int]],
    slots: list[int],
    has_initial: list[bool],
    sample_mask: list[bool],
    num_decodes: int,
    page_size: int,
    device: torch.device,
    num_verify: int = 0,
    page_table: bool = True,
    prompt_rows: list[int] | None = None,
    rope_positions: list[np.ndarray | None] | None = None,
) -> ForwardBatch:
    """token_lists[i] are request i's new tokens, at positions starts[i]...; pages its KV pages.
    `prompt_rows[i]`: logits of request i's first so many new positions too, after all sampled
    rows (prompt log-probabilities).
    `page_table=False` leaves the page table out (a decode batch, whose table the attention
    backend keeps on the device, `engine/cache/page_table.py`).
    `rope_positions[i]`: request i's M-RoPE positions `[3, n]` of its new tokens (a prompt with
    images), where the token's index is not its position; the batch's positions are 3-D only
    where they differ along the three axes."""
    source = dict(
        token_lists=token_lists,
        starts=starts,
        pages=pages,
        slots=slots,
        has_initial=has_initial,
        sample_mask=sample_mask,
        num_decodes=num_decodes,
        page_size=page_size,
        num_verify=num_verify,
        page_table=page_table,
        prompt_rows=prompt_rows,
        rope_positions=rope_positions,
    )
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu = [0]
    logits_indices: list[int] = []
    # decode rows (one token each) first, without the general loop's ranges and generators:
    # at batch 256 this loop is a measurable part of the host's step
    for i in range(num_decodes):
        (tok,), p, pg = token_lists[i], starts[i], pages[i]
        input_ids.append(tok)
        positions.append(p)
        slot_mapping.append(pg[p // page_size] * page_size + p % page_size)
        if sample_mask[i]:
            logits_indices.append(i)
    cu.extend(range(1, num_decodes + 1))
    verify = range(num_decodes, num_decodes + num_verify)
    for i in range(num_decodes, len(token_lists)):
        toks, start, pg, sample = token_lists[i], starts[i], pages[i], sample_mask[i]
        if i in verify:  # every position's logits: the target's choice after each draft
            logits_indices.extend(range(cu[-1], cu[-1] + len(toks)))
        input_ids.extend(toks)
        pos = range(start, start + len(toks))
        positions.extend(pos)
        if len(toks) > _VECTOR_ROWS:  # a long chunk: numpy, not a Python loop per token
            p_np = np.arange(start, start + len(toks))
            pages_np = np.asarray(pg, dtype=np.int64)[p_np // page_size]
            slot_mapping.extend((pages_np * page_size + p_np % page_size).tolist())
        else:
            slot_mapping.extend(pg[p // page_size] * page_size + p % page_size for p in pos)
        cu.append(cu[-1] + len(toks))
        if sample and i not in verify:
            logits_indices.append(cu[-1] - 1)
    num_prompt_logits = 0
    for i, rows in enumerate(prompt_rows or []):
        logits_indices.extend(range(cu[i], cu[i] + rows))
        num_prompt_logits += rows
    max_pages = max(len(p) for p in pages)
    table = [p + [0] * (max_pages - len(p)) for p in pages] if page_table else []
    first_prefill = num_decodes + num_verify
    pos_rows: list[int] | np.ndarray = positions
    if rope_positions is not None and any(r is not None for r in rope_positions):
        pos_rows = rope_grid(positions, cu, rope_positions)
    chunks = fla_chunk_indices([len(t) for t in token_lists[first_prefill:]], FLA_CHUNK)

    (ids, pos_t, cu_t, lens, table_t, slot_map, slots_t, initial, logits_idx, chunks_t) = to_device_packed(
        [
            (input_ids, torch.long),
            (pos_rows, torch.long),
            (cu, torch.int32),
            ([s + len(x) for s, x in zip(starts, token_lists)], torch.int32),
            (table, torch.int32),
            (slot_mapping, torch.long),
            (slots, torch.int32),
            (has_initial, torch.bool),
            (logits_indices, torch.long),
            (chunks, torch.long),
        ],
        device,
    )
    return ForwardBatch(
        input_ids=ids,
        positions=pos_t.view(3, -1) if pos_t.shape[0] > len(positions) else pos_t,
        num_decodes=num_decodes,
        max_seqlen_q=max(len(x) for x in token_lists),
        cu_seqlens_q=cu_t,
        seq_lens=lens,
        page_table=table_t if page_table else None,
        slot_mapping=slot_map,
        state_slots=slots_t,
        has_initial_state=initial,
        logits_indices=logits_idx,
        verify_lens=[len(token_lists[i]) for i in verify],
        page_columns=max_pages,
        prefill_chunk_indices=chunks_t.view(-1, 2) if chunks else None,
        num_prompt_logits=num_prompt_logits,
        source=source,
    )


def fla_chunk_indices(lengths: list[int], chunk: int) -> list[int]:
    """FLA's `prepare_chunk_indices` on the host, flattened: (sequence, chunk within it) for every
    `chunk`-token chunk of each sequence."""
    if not lengths:
        return []
    counts = -(-np.asarray(lengths, dtype=np.int64) // chunk)
    seq = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    within = np.arange(seq.shape[0], dtype=np.int64) - starts
    return np.stack([seq, within], 1).reshape(-1).tolist()


def rope_grid(positions: list[int], cu: list[int], rope_positions: list[np.ndarray | None]) -> np.ndarray:
    """The batch's positions with each request's own M-RoPE rows in place: `[T]` when all three
    axes agree (text, and decode past an image: one-dimensional, graphs replay), else `[3, T]`
    flattened."""
    grid = np.tile(np.asarray(positions, dtype=np.int64), (3, 1))
    for i, rows in enumerate(rope_positions):
        if rows is not None:
            grid[:, cu[i] : cu[i + 1]] = rows
    if (grid[0] == grid[1]).all() and (grid[0] == grid[2]).all():
        return grid[0]
    return grid.reshape(-1)
