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


def test_clamped_slots_keep_kv_pages_for_their_requests() -> None:
    # 100 MiB less the padding slot: each running request takes its state slot, its snapshot slot
    # (1 MiB each) and the 64 pages of 64 KiB its 1,024 tokens fill, 6 MiB in all, so 16 run
    # (not the 47 whose slots alone fit, which would leave pages for one request at a time)
    cfg = config(max_running_requests=64, pool_memory_gb=100 / 1024)
    sizes = plan_pools(
        cfg, bytes_per_page=64 * 1024, bytes_per_slot=MIB, max_position_embeddings=4096, device=CPU
    )
    assert sizes.num_slots == 16 and cfg.max_running_requests == 16  # what the scheduler admits
    assert 16 <= sizes.num_snapshots <= 19  # one a request, and the tree's from the last 3 MiB
    used = (1 + sizes.num_slots + sizes.num_snapshots) * MIB + sizes.num_pages * 64 * 1024
    assert used <= 100 * MIB
    assert (sizes.num_pages - 1) * cfg.page_size >= 16 * 1024  # every running request at full length
    assert sizes.max_model_len == 1024


def test_long_model_lengths_plan_4k_tokens_a_request() -> None:
    # a hybrid model's state slot (64 MiB) costs as much as 8k tokens of its KV (8 KiB a token):
    # 8 GiB less the padding slot holds 50 requests of two slots and 4,096 tokens (160 MiB each),
    # not the 55 whose slots fit beside one 131,072-token request's pages (32 requests of 4k)
    cfg = config(max_running_requests=256)
    cfg.max_model_len = 131072
    cfg.pool_memory_gb = 8.0
    sizes = plan_pools(cfg, 16 * 8 * 1024, 64 * MIB, 131072, CPU)
    assert sizes.num_slots == 50 and 50 <= sizes.num_snapshots <= 51
    assert (sizes.num_pages - 1) * cfg.page_size >= 50 * 4096
    assert sizes.max_model_len == 131072  # one request of the full length still fits


def test_naive_cache_needs_no_snapshot_slots() -> None:
    # one state slot and 4 MiB of pages a request: 39 MiB less the padding slot holds 7
    cfg = config(max_running_requests=64, pool_memory_gb=40 / 1024, cache_type="naive")
    sizes = plan_pools(
        cfg, bytes_per_page=64 * 1024, bytes_per_slot=MIB, max_position_embeddings=4096, device=CPU
    )
    assert sizes.num_snapshots == 0 and sizes.num_slots == 7


def test_a_fixed_page_count_short_of_max_model_len_names_the_settings_that_fix_it() -> None:
    # 10 pages of 16 tokens, one of them padding: 144 tokens, where 1,024 need 65 pages
    with pytest.raises(ValueError, match="exceeds the KV capacity of 144 tokens") as refused:
        plan_pools(
            config(num_kv_pages=10),
            bytes_per_page=4096,
            bytes_per_slot=MIB,
            max_position_embeddings=4096,
            device=CPU,
        )
    assert "lower --max-model-len (LLM: max_model_len)" in str(refused.value)
    assert "raise num_kv_pages to at least 65" in str(refused.value)
    sizes = plan_pools(
        config(num_kv_pages=65),
        bytes_per_page=4096,
        bytes_per_slot=MIB,
        max_position_embeddings=4096,
        device=CPU,
    )
    assert sizes.max_model_len == 1024


def test_refused_only_when_not_one_request_fits() -> None:
    cfg = config(max_running_requests=4, pool_memory_gb=3 / 1024)
    with pytest.raises(ValueError, match="not enough memory for one request") as refused:
        plan_pools(
            cfg, bytes_per_page=64 * 1024, bytes_per_slot=MIB, max_position_embeddings=4096, device=CPU
        )
    # on CPU the pools' flag is --pool-memory-gb; a tiny model's sizes are not rounded to zero
    assert "raise --pool-memory-gb" in str(refused.value) and "3.0 MiB" in str(refused.value)
    tiny = config(max_running_requests=4, pool_memory_gb=2 / 2**20)
    with pytest.raises(ValueError) as small:
        plan_pools(
            tiny, bytes_per_page=512, bytes_per_slot=3 * 1024, max_position_embeddings=4096, device=CPU
        )
    assert "a state slot takes 3.0 KiB" in str(small.value)


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


def test_a_fixed_pool_size_replaces_the_fraction_on_cuda(monkeypatch) -> None:
    """--pool-memory-gb (vLLM's --kv-cache-memory-bytes) sizes the pools on CUDA too, where the
    static fraction sized them alone; more than the GPU has free is refused before allocating."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Gpu())
    gpu = torch.device("cuda", 0)
    kw = {"model": "unused", "device": "cuda", "max_model_len": 1024, "max_running_requests": 64}
    fraction = plan_pools(EngineConfig(**kw), 64 * 1024, MIB, 4096, gpu)
    assert fraction.num_slots == 64  # 28 GiB: 40 free less the 15% of 80 left out
    cfg = EngineConfig(**kw, pool_memory_gb=100 / 1024)  # as on CPU: 16 requests' slots and pages
    sizes = plan_pools(cfg, 64 * 1024, MIB, 4096, gpu)
    assert sizes.num_slots == 16 and cfg.max_running_requests == 16
    assert (1 + sizes.num_slots + sizes.num_snapshots) * MIB + sizes.num_pages * 64 * 1024 <= 100 * MIB
    with pytest.raises(ValueError, match="more than the 40.0 GiB the GPU has free"):
        plan_pools(EngineConfig(**kw, pool_memory_gb=48.0), 64 * 1024, MIB, 4096, gpu)


class _Gpu:
    total_memory = 80 * 2**30


def test_auto_max_model_len_lowers_it_to_what_one_request_holds(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's max_model_len -1 (`--max-model-len auto`): the model's positions where one request of
    them fits, else the whole pages one request holds, logged, where the model's length (None) is
    refused. 8 MiB less the padding slot, the request's state and snapshot slots (1 MiB each) and
    the padding page leave 79 pages of 64 KiB: 1,264 tokens."""
    cpu = dict(model="unused", device="cpu", max_running_requests=4)
    sizes_of = dict(bytes_per_page=64 * 1024, bytes_per_slot=MIB, max_position_embeddings=4096, device=CPU)
    with pytest.raises(ValueError, match="not enough memory for one request"):
        plan_pools(EngineConfig(**cpu, pool_memory_gb=8 / 1024), **sizes_of)
    cfg = EngineConfig(**cpu, pool_memory_gb=8 / 1024, max_model_len=-1)
    with caplog.at_level("INFO", logger="deltaserve.engine.cache.pool_sizing"):
        sizes = plan_pools(cfg, **sizes_of)
    assert sizes.max_model_len == 1264 and sizes.num_slots == 1 and cfg.max_running_requests == 1
    assert (sizes.num_pages - 1) * cfg.page_size >= 1264  # the request at full length
    assert (1 + sizes.num_slots + sizes.num_snapshots) * MIB + sizes.num_pages * 64 * 1024 <= 8 * MIB
    assert "max_model_len auto: lowered from 4096 to 1264 tokens to fit in the pools" in caplog.text
    caplog.clear()
    roomy = EngineConfig(**cpu, pool_memory_gb=1.0, max_model_len=-1)
    with caplog.at_level("INFO", logger="deltaserve.engine.cache.pool_sizing"):
        sizes = plan_pools(roomy, **sizes_of)
    assert sizes.max_model_len == 4096 and sizes.num_slots == 4
    assert "max_model_len auto: the model's full context of 4096 tokens fits in the pools" in caplog.text
    # a fixed page count bounds it too
    sizes = plan_pools(EngineConfig(**cpu, num_kv_pages=33, max_model_len=-1), **sizes_of)
    assert sizes.max_model_len == 512
    with pytest.raises(
        ValueError, match="^max_model_len auto: not enough memory for one request of one page"
    ):
        plan_pools(EngineConfig(**cpu, pool_memory_gb=3 / 1024, max_model_len=-1), **sizes_of)
    with pytest.raises(ValueError, match="max_model_len must be at least 2 .* or -1"):
        EngineConfig(**cpu, max_model_len=-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pools_sized_by_bytes_on_cuda() -> None:
    """On a GPU `pool_memory_gb` (and vLLM's `kv_cache_memory_bytes`) sets what the pools take in
    place of the memory fraction: 2 GiB and 8 GiB hold about four times as many requests apart;
    more than the GPU has free is an error before the pools allocate; `max_model_len=-1` lowers
    the model's 262k positions to what 1 GiB holds for one request."""
    from deltaserve import LLM, SamplingParams

    def pools(**kw: object) -> tuple[int, int, int | None]:
        before = torch.cuda.memory_allocated()
        llm = LLM("configs/qwen3.5-0.8b", load_format="dummy", enforce_eager=True, **kw)  # type: ignore[arg-type]
        taken = torch.cuda.memory_allocated() - before
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        running, length = int(llm.engine.config.max_running_requests), llm.engine.max_model_len
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
        return taken, running, length

    small, running_small, _ = pools(pool_memory_gb=2, max_model_len=8192)
    large, running_large, _ = pools(kv_cache_memory_bytes=8 * 2**30, max_model_len=8192)
    assert 5.5 * 2**30 < large - small < 6.5 * 2**30  # the pools' 6 GiB apart, the weights alike
    assert 3 * running_small < running_large
    with pytest.raises(ValueError, match="more than the .* the GPU has free"):
        LLM("configs/qwen3.5-0.8b", load_format="dummy", enforce_eager=True, pool_memory_gb=100_000)
    _, _, length = pools(pool_memory_gb=1, max_model_len=-1)
    assert length is not None and 16 <= length < 262_144 and length % 16 == 0
