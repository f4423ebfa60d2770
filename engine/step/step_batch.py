"""One step's plan (`SchedulerOutput`) as the runner's `ForwardBatch`."""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.engine.runner.forward_batch import ForwardBatch, build_forward_batch
from deltaserve.engine.runner.model_runner import ModelRunner
from deltaserve.engine.step.prompt_logprobs import prompt_rows
from deltaserve.engine.step.scheduler import ScheduledChunk, SchedulerOutput
from deltaserve.models.forward import ImageEmbeds


def _tokens(c: ScheduledChunk) -> list[int]:
    start = c.req.num_computed_tokens
    end = start + c.num_tokens - len(c.drafts)
    toks = c.req.token_slice(start, end)
    if len(toks) < end - start:  # overlap: a placeholder, filled on the device
        toks = toks + [0] * (end - start - len(toks))
    return toks + c.drafts


def build_step_batch(
    plan: SchedulerOutput, runner: ModelRunner, page_size: int, device: torch.device
) -> ForwardBatch:
    chunks = plan.chunks
    pages = [c.req.pages for c in chunks]
    slots = [c.req.slot or 0 for c in chunks]
    table = runner.decode_page_table(len(chunks), plan.num_decodes)
    if table is not None:  # a decode graph reads the device's table: send what changed
        table.update(slots, pages)
    images = any(c.req.images is not None for c in chunks)
    batch = build_forward_batch(
        token_lists=[_tokens(c) for c in chunks],
        starts=[c.req.num_computed_tokens for c in chunks],
        pages=pages,
        slots=slots,
        has_initial=[c.req.num_computed_tokens > 0 or c.req.has_initial_state for c in chunks],
        sample_mask=[c.sample for c in chunks],
        num_decodes=plan.num_decodes,
        page_size=page_size,
        device=device,
        num_verify=plan.num_verify,
        page_table=table is None,
        prompt_rows=[prompt_rows(c.req, c.req.num_computed_tokens, c.num_tokens) for c in chunks]
        if any(c.req.params.prompt_logprobs is not None for c in chunks)
        else None,
        rope_positions=[_rope_positions(c) for c in chunks] if images else None,
    )
    if images:
        batch.image_embeds = _image_embeds(chunks, device)
    return batch


def _rope_positions(c: ScheduledChunk) -> np.ndarray | None:
    if c.req.images is None:
        return None
    start = c.req.num_computed_tokens
    return c.req.images.positions_of(start, start + c.num_tokens)


def _image_embeds(chunks: list[ScheduledChunk], device: torch.device) -> ImageEmbeds | None:
    """The batch rows of the image tokens its chunks carry, and the tower's embeddings for them."""
    rows: list[np.ndarray] = []
    embeds: list[torch.Tensor] = []
    offset = 0
    for c in chunks:
        images = c.req.images
        if images is not None and images.embeds is not None:
            at, lo, hi = images.image_rows(
                c.req.num_computed_tokens, c.req.num_computed_tokens + c.num_tokens
            )
            if hi > lo:
                rows.append(at + offset)
                embeds.append(images.embeds[lo:hi])
        offset += c.num_tokens
    if not rows:
        return None
    return torch.from_numpy(np.concatenate(rows)).to(device), torch.cat(embeds)
