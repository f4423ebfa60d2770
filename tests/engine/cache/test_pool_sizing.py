"""Pool sizing: requested slots that do not fit are clamped (and the engine starts), not refused."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.engine.cache.pool_sizing import plan_pools
from deltaserve.engine.config import EngineConfig

MIB = 2**20
CPU = torch.device("cpu")


def config(**kw) -> EngineConfig:
    return EngineConfig(model="unused", device="cpu", max_model_len=1024, **kw)


def test_everything_fits_nothing_changes() -> None:
    cfg = config(max_running_requests=8, pool_memory_gb=1.0)
    sizes = plan_pools(cfg, bytes_per_page=4096, bytes_per_slot=MIB, max_position_embeddings=4096, device=CPU)
    assert (sizes.num_slots, sizes.num_snapshots, cfg.max_running_requests) == (8, 16, 8)


def test_too_many_slots_are_clamped_snapshots_first() -> None:
    # 100 MiB: one full-length request's pages (64 + the padding page, of 64 KiB) and 1 padding
    # slot leave 94 one-MiB slots, not the 64 + 128 asked for
    cfg = config(max_running_requests=64, pool_memory_gb=100 / 1024)
    sizes = plan_pools(
        cfg, bytes_per_page=64 * 1024, bytes_per_slot=MIB, max_position_embeddings=4096, device=CPU
    )
    assert sizes.num_slots == 47 and sizes.num_snapshots == 47  # one snapshot slot per request
    assert cfg.max_running_requests == 47  # the scheduler admits what the pool holds
    used = (1 + sizes.num_slots + sizes.num_snapshots) * MIB + (sizes.num_pages - 1) * 64 * 1024
    assert used <= 100 * MIB
    assert sizes.max_model_len == 1024  # a request of the full length still fits


def test_only_the_tree_snapshots_go_when_that_suffices() -> None:
    cfg = config(max_running_requests=32, pool_memory_gb=90 / 1024)
    sizes = plan_pools(
        cfg, bytes_per_page=64 * 1024, bytes_per_slot=MIB, max_position_embeddings=4096, device=CPU
    )
    assert sizes.num_slots == 32 and 32 <= sizes.num_snapshots < 64


def test_naive_cache_needs_no_snapshot_slots() -> None:
    cfg = config(max_running_requests=64, pool_memory_gb=40 / 1024, cache_type="naive")
    sizes = plan_pools(
        cfg, bytes_per_page=64 * 1024, bytes_per_slot=MIB, max_position_embeddings=4096, device=CPU
    )
    assert sizes.num_snapshots == 0 and sizes.num_slots == 34


def test_refused_only_when_not_one_request_fits() -> None:
    cfg = config(max_running_requests=4, pool_memory_gb=3 / 1024)
    with pytest.raises(ValueError, match="not enough memory for one request"):
        plan_pools(
            cfg, bytes_per_page=64 * 1024, bytes_per_slot=MIB, max_position_embeddings=4096, device=CPU
        )


def test_cpu_default_follows_available_memory(monkeypatch) -> None:
    from deltaserve.engine.cache import pool_sizing

    monkeypatch.setattr(pool_sizing, "_available_bytes", lambda: 64 * 2**30)
    cfg = config(max_running_requests=256)
    big = plan_pools(cfg, 64 * 1024, 20 * MIB, 4096, CPU)
    assert big.num_slots == 256  # 16 GiB: 768 slots of 20 MiB fit
    monkeypatch.setattr(pool_sizing, "_available_bytes", lambda: 8 * 2**30)
    cfg = config(max_running_requests=256)
    small = plan_pools(cfg, 64 * 1024, 20 * MIB, 4096, CPU)
    assert small.num_slots < 256 and math.isclose(cfg.max_running_requests, small.num_slots)
