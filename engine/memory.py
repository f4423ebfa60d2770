"""Sizing the KV page pool and the state pool."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltaserve.engine.config import EngineConfig

# a CPU machine has no "free device memory" to fill: give the pools this much
_CPU_POOL_BYTES = 2 << 30


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int  # including the padding page
    num_slots: int  # working slots (excluding the padding slot)
    num_snapshots: int
    max_model_len: int


def plan_pools(
    config: EngineConfig,
    bytes_per_page: int,
    bytes_per_slot: int,
    max_position_embeddings: int,
    device: torch.device,
) -> PoolSizes:
    slots = config.max_running_requests
    snapshots = config.num_snapshot_slots
    if snapshots is None:
        # Each running request holds one snapshot slot for the state at its last page
        # boundary (its end snapshot at finish); as many again hold the tree's snapshots.
        snapshots = 2 * slots if config.cache_type == "radix" else 0
    page = config.page_size
    want_len = min(config.max_model_len or max_position_embeddings, max_position_embeddings)
    if config.num_kv_pages is not None:
        pages = config.num_kv_pages
    else:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            total = torch.cuda.get_device_properties(device).total_memory
            budget = int(free - total * (1.0 - config.mem_fraction_static))
        else:
            budget = _CPU_POOL_BYTES
        spec = config.spec
        # the speculative window buffer: k + 1 states for each request verified in a step
        window = config.spec_window_rows * (spec.num_speculative_tokens + 1) if spec else 0
        budget -= (1 + slots + snapshots + window) * bytes_per_slot
        if budget <= 0:
            raise ValueError(
                f"not enough memory for {slots + snapshots} state slots of {bytes_per_slot / 2**20:.1f} MiB; "
                "lower --max-running-requests"
            )
        pages = budget // max(bytes_per_page, 1)
        # no use in more pages than every running request at full length can fill
        pages = min(pages, math.ceil(want_len / page) * slots + 1)
    pages = max(int(pages), 2)
    capacity = (pages - 1) * page
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV capacity of {capacity} tokens")
    return PoolSizes(pages, slots, snapshots, min(want_len, capacity))
