"""Sizing the KV page pool and the state pool."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from deltaserve.engine.config import AUTO_MAX_MODEL_LEN, EngineConfig
from deltaserve.models.layers.attention import check_max_model_len

logger = logging.getLogger(__name__)

_CPU_POOL_SHARE = 0.25  # a CPU machine's pools get this share of the memory available at start-up
_CPU_POOL_MIN = 1 << 30
# when memory clamps the slots, KV pages planned for each running request: enough that 32 requests
# of 9k tokens run on 80B-A3B FP8 (8k in / 1k out), few enough to keep the running requests of
# models whose state slots are large (Kimi-Linear, 35B-A3B) near what they were
KV_TOKENS_PER_REQUEST = 4096


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
    """Pages and slots for the memory the weights leave. Requested slots that do not fit are
    clamped: as many running requests as hold their slots and KV pages for `KV_TOKENS_PER_REQUEST`
    tokens each (or the model length, if shorter), then the prefix cache's tree snapshots with what
    is left, always leaving KV pages for one request of the full model length; only when not one
    request fits is it an error. A clamp lowers `config.max_running_requests`, which the scheduler
    reads."""
    slots = config.num_running
    snapshots = config.num_snapshot_slots
    if snapshots is None:
        # Each running request holds one snapshot slot for the state at its last page
        # boundary (its end snapshot at finish); as many again hold the tree's snapshots.
        snapshots = 2 * slots if config.cache_type == "radix" else 0
    page = config.page_size
    auto = config.max_model_len == AUTO_MAX_MODEL_LEN
    given = None if auto else config.max_model_len
    check_max_model_len(given, max_position_embeddings)
    want_len = given or max_position_embeddings
    spec = config.spec
    # the speculative window buffer: k + 1 states for each request verified in a step
    window = config.spec_window_rows * (spec.num_speculative_tokens + 1) if spec else 0
    if config.num_kv_pages is not None:
        pages = config.num_kv_pages
    else:
        budget = _pool_budget(config, device)
        base = budget - (1 + window) * bytes_per_slot  # less the padding slot and the window's
        if auto:
            want_len = _fitted_len(want_len, budget, base, bytes_per_page, bytes_per_slot, config, device)
        one_request = (math.ceil(want_len / page) + 1) * max(bytes_per_page, 1)  # with the padding page
        fit = (base - one_request) // max(bytes_per_slot, 1)
        if slots + snapshots > fit:
            asked = (slots, snapshots)
            per_request = 1 if config.cache_type == "radix" else 0  # a snapshot slot each, at least
            tree = snapshots - per_request * slots
            # running requests first, each with its slots and KV pages for KV_TOKENS_PER_REQUEST
            # tokens (not only one request's of the full length: requests would wait for pages while
            # slots sat idle); the tree's snapshots get what is left
            kv_each = math.ceil(min(want_len, KV_TOKENS_PER_REQUEST) / page) * bytes_per_page
            per_slot_set = (1 + per_request) * bytes_per_slot + kv_each
            held = (base - bytes_per_page) // max(per_slot_set, 1)  # with the padding page
            slots = min(slots, int(fit // (1 + per_request)), int(held))
            if slots < 1:
                raise ValueError(
                    f"not enough memory for one request: the pools have {_size(budget)}, a state slot "
                    f"takes {_size(bytes_per_slot)} and KV pages for {want_len} tokens {_size(one_request)}; "
                    f"free memory, lower --max-model-len (LLM: max_model_len) or raise {_budget_flag(config, device)}"
                )
            kv = max(one_request, slots * kv_each + bytes_per_page)
            left = base - kv - (1 + per_request) * slots * bytes_per_slot
            snapshots = per_request * slots + max(0, min(tree, int(left // max(bytes_per_slot, 1))))
            logger.warning(
                "memory holds %d running requests and %d snapshot slots, not the %d and %d asked for "
                "(a slot is %.1f MiB, with KV pages for %d tokens a request); clamped",
                slots,
                snapshots,
                *asked,
                bytes_per_slot / 2**20,
                min(want_len, KV_TOKENS_PER_REQUEST),
            )
            config.max_running_requests = slots
        budget -= (1 + slots + snapshots + window) * bytes_per_slot
        pages = budget // max(bytes_per_page, 1)
        # no use in more pages than every running request at full length can fill
        pages = min(pages, math.ceil(want_len / page) * slots + 1)
    pages = max(int(pages), 2)
    capacity = (pages - 1) * page
    if config.max_model_len is not None and config.max_model_len > capacity:
        needed = math.ceil(config.max_model_len / page) + 1  # with the padding page
        if config.num_kv_pages is not None:
            more = f"raise num_kv_pages to at least {needed} (or leave it unset: memory sizes the pools)"
        else:
            more = f"raise {_budget_flag(config, device)}"
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the KV capacity of {capacity} tokens "
            f"({pages} pages of {page}, one of them padding); lower --max-model-len (LLM: max_model_len) "
            f"or {more}"
        )
    if auto and config.num_kv_pages is not None:
        _log_fitted(max_position_embeddings, min(want_len, capacity), (pages - 1) * bytes_per_page)
    return PoolSizes(pages, slots, snapshots, min(want_len, capacity))


def _fitted_len(
    longest: int,
    budget: int,
    base: int,
    bytes_per_page: int,
    bytes_per_slot: int,
    config: EngineConfig,
    device: torch.device,
) -> int:
    """vLLM's `--max-model-len auto`: `longest` (the model's positions) where the pools hold one
    request of it, else the most whole pages of KV that one request holds beside its state slots
    (`base`: the pools' `budget` less the padding and window slots; the padding page), logged
    either way; a ValueError where not one page fits."""
    per_request = 1 if config.cache_type == "radix" else 0  # its snapshot slot
    kv_bytes = base - (1 + per_request) * bytes_per_slot - bytes_per_page  # less the padding page
    pages = kv_bytes // bytes_per_page if bytes_per_page > 0 else math.ceil(longest / config.page_size)
    fitted = min(longest, int(pages) * config.page_size)
    if fitted < 2:
        raise ValueError(
            f"max_model_len auto: not enough memory for one request of one page: the pools have "
            f"{_size(budget)}, a state slot takes {_size(bytes_per_slot)} and a page of "
            f"{config.page_size} tokens {_size(bytes_per_page)}; free memory or raise {_budget_flag(config, device)}"
        )
    _log_fitted(longest, fitted, kv_bytes)
    return fitted


def _budget_flag(config: EngineConfig, device: torch.device) -> str:
    """The setting that sizes the pools, as the CLI and the offline LLM name it (either raised this)."""
    if device.type == "cuda" and config.pool_memory_gb is None:
        return "--mem-fraction-static (LLM: gpu_memory_utilization)"
    return "--pool-memory-gb (LLM: pool_memory_gb or kv_cache_memory_bytes)"


def _log_fitted(longest: int, fitted: int, kv_bytes: int) -> None:
    if fitted >= longest:
        logger.info("max_model_len auto: the model's full context of %d tokens fits in the pools", longest)
    else:
        logger.info(
            "max_model_len auto: lowered from %d to %d tokens to fit in the pools (%s for one request's KV pages)",
            longest,
            fitted,
            _size(kv_bytes),
        )


def _size(num_bytes: float) -> str:
    """Bytes in the unit that shows them: a tiny model's slot is kilobytes, a large one's gigabytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} bytes"


def _pool_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV and state pools: `pool_memory_gb` where given (vLLM's kv_cache_memory_bytes:
    on CUDA it replaces the static fraction), else on CUDA what the weights leave of the static
    fraction, on CPU a share of the memory available now."""
    if config.pool_memory_gb is not None:
        budget = int(config.pool_memory_gb * 2**30)
        free = int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else budget
        if budget > free:  # the pools would fail to allocate, or leave nothing for activations
            raise ValueError(
                f"the pools were given {_size(budget)} (--pool-memory-gb, --kv-cache-memory-bytes; "
                f"LLM: pool_memory_gb, kv_cache_memory_bytes), "
                f"more than the {_size(free)} the GPU has free after the weights"
            )
        return budget
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        total = torch.cuda.get_device_properties(device).total_memory
        return int(free - total * (1.0 - config.mem_fraction_static))
    # data-parallel replicas start together and see the same memory: each takes its part of the share
    share = _CPU_POOL_SHARE / config.data_parallel_size
    return max(_CPU_POOL_MIN, int(_available_bytes() * share))


def free_memory_bytes(device: torch.device) -> int:
    """The device's free memory now: the GPU's, or on CPU the memory the OS can still give."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return _available_bytes()


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
