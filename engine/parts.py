"""The engine's parts, built from its config, each handed its dependencies as it is made.

Two groups: what serves the model (`ModelParts`: the runner and its pools, the sampler,
admission, overlap), built once; and what the requests leave state in (`LoopParts`: the
prefix cache, the speculative decoder, the scheduler, the token sink and its counters), which
a warm-up builds anew so that the engine starts as new.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deltaserve.engine.cache.adapter import PrefixCache, make_prefix_cache, prefill_cost
from deltaserve.engine.cache.cache_policy import HybridPrefillCost
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.requests.generation_defaults import eos_token_ids_of
from deltaserve.engine.requests.request import Request
from deltaserve.engine.runner.model_runner import ModelRunner
from deltaserve.engine.sampling.sampler import SAMPLER_GRAPH_MAX_BS, Sampler
from deltaserve.engine.spec_decode import MtpDrafter, SpecDecoder
from deltaserve.engine.step.admission import Admission, ImageInput, LazyGrammars
from deltaserve.engine.step.overlap import Overlap
from deltaserve.engine.step.scheduler import Scheduler, reserve_pages
from deltaserve.engine.step.token_sink import TokenSink, new_counters
from deltaserve.models.checkpoints.loader import LoadedModel, load_model, load_tokenizer
from deltaserve.models.parallel import SINGLE, TensorParallel
from deltaserve.models.vision.processor import ImageProcessor

if TYPE_CHECKING:
    from deltaserve.engine.parallel.group import RankGroups


@dataclass
class ModelParts:
    model_config: Any  # the text model's HF config
    vocab_size: int
    tokenizer: Any
    eos_token_ids: list[int]
    runner: ModelRunner
    max_model_len: int
    prefill_cost: HybridPrefillCost  # the prefix cache weighs snapshots by it
    sampler: Sampler
    grammars: LazyGrammars
    admission: Admission
    overlap: Overlap | None  # with `enable_overlap_schedule`
    model_info: dict[str, Any]
    image_processor: ImageProcessor | None  # a vision tower's: images in prompts


@dataclass
class LoopParts:
    prefix_cache: PrefixCache
    spec: SpecDecoder | None
    scheduler: Scheduler
    counters: dict[str, int]
    sink: TokenSink


def load_engine_model(config: EngineConfig, device: torch.device, tp: TensorParallel) -> LoadedModel:
    """The model as `config` asks for it, this rank's slice of it under `tp` (every rank's the same way)."""
    torch.manual_seed(config.seed)
    return load_model(
        config.model,
        config.torch_dtype,
        device,
        config.load_format,
        config.seed,
        quantization=config.quantization,
        tp=tp,
        hf_overrides=config.hf_overrides,
        vision=not config.language_model_only,
    )


def build_model_parts(config: EngineConfig, device: torch.device, groups: RankGroups | None) -> ModelParts:
    loaded = load_engine_model(
        config, device, groups.tp if groups is not None else (config.tensor_parallel or SINGLE)
    )
    vocab_size = int(loaded.config.vocab_size)
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
    eos_token_ids = eos_token_ids_of(config.model, loaded.config, tokenizer)
    runner = ModelRunner(config, loaded, device, groups)
    max_model_len = runner.sizes.max_model_len
    cost = prefill_cost(loaded.config, runner.model.layer_types, loaded.num_params)
    # small sampled batches replay CUDA graphs of the sampler (engine/sampling/sampler_graphs.py)
    graphs = device.type == "cuda" and not config.disable_cuda_graph
    sampler = Sampler(
        device,
        config.seed + config.data_parallel_rank,  # replicas draw unseeded requests' noise apart
        eos_token_ids,
        graph_max_bs=min(SAMPLER_GRAPH_MAX_BS, config.cuda_graph_max_bs) if graphs else 0,
    )
    grammars = LazyGrammars(tokenizer, vocab_size, eos_token_ids)
    images = image_input_of(loaded, config)
    processor = None
    if loaded.vision is not None:
        processor = ImageProcessor.from_checkpoint(config.model, loaded.vision_config)
    return ModelParts(
        model_config=loaded.config,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        runner=runner,
        max_model_len=max_model_len,
        prefill_cost=cost,
        sampler=sampler,
        grammars=grammars,
        admission=Admission(config, vocab_size, max_model_len, tokenizer, sampler, grammars, images),
        overlap=Overlap(sampler, device, config.num_running) if config.enable_overlap_schedule else None,
        model_info={**_model_info(config, loaded, device, runner), "images": _images_info(images, processor)},
        image_processor=processor,
    )


def image_input_of(loaded: LoadedModel, config: EngineConfig) -> ImageInput:
    """What the engine does with a prompt's images: read them (a vision tower is loaded), or
    refuse them saying why."""
    if loaded.vision is not None:
        assert loaded.image_token_id is not None
        return ImageInput(loaded.image_token_id, int(loaded.vision_config.spatial_merge_size))
    arch = loaded.architecture
    if not arch.endswith("ConditionalGeneration"):
        why = f"the model ({arch}) reads text only"
    elif config.language_model_only:
        why = "this server was started with --language-model-only: it reads text only"
    else:
        why = f"the checkpoint ({arch}) has no vision tower"
    return ImageInput(refusal=why)


def _images_info(images: ImageInput, processor: ImageProcessor | None) -> dict[str, Any]:
    """How the HTTP processes read a prompt's images (`server/api/images.py`), or why they refuse them."""
    if processor is None:
        return {"refusal": images.refusal}
    return {"processor": dataclasses.asdict(processor), "image_token_id": images.image_token_id}


def build_loop_parts(config: EngineConfig, model: ModelParts, requests: dict[str, Request]) -> LoopParts:
    """A new prefix cache, and new parts over it; `requests` is the engine's table of live ones."""
    runner = model.runner
    kv, st = runner.kv_pool, runner.state_pool
    prefix_cache = make_prefix_cache(config, kv, st, model.prefill_cost)
    spec = None
    max_verify = 0
    if config.spec is not None:
        assert runner.window is not None
        mtp = None
        if runner.mtp is not None:
            reserve = functools.partial(reserve_pages, prefix_cache, kv.page_size)
            mtp = MtpDrafter(runner, reserve, config.spec.num_speculative_tokens)
        spec = SpecDecoder(config.spec, runner.window, model.sampler, model.max_model_len, mtp)
        max_verify = runner.window.rows
    scheduler = Scheduler(
        config,
        kv,
        st,
        prefix_cache,
        propose=spec.propose if spec is not None else None,
        max_verify=max_verify,
    )
    counters = new_counters()
    sink = TokenSink(
        scheduler, requests, counters, model.eos_token_ids, model.max_model_len, config.stream_interval
    )
    return LoopParts(prefix_cache, spec, scheduler, counters, sink)


def _model_info(
    config: EngineConfig, loaded: LoadedModel, device: torch.device, runner: ModelRunner
) -> dict[str, Any]:
    """What the start-up summary and `/v1/models` report about the model and the pools."""
    return {
        "model": config.model,
        "architecture": loaded.architecture,
        "dtype": config.dtype,
        "device": str(device),
        "tensor_parallel_size": config.tensor_parallel_size,
        "expert_parallel": loaded.tp.experts_whole,
        "data_parallel_size": config.data_parallel_size,
        "weight_version": "default",  # SGLang's label of the weights served (set by updates)
        "num_params": loaded.num_params,
        "kv_capacity_tokens": runner.kv_pool.capacity * config.page_size,
        "state_slots": runner.state_pool.num_working,
        "max_model_len": runner.sizes.max_model_len,
        "cache_type": config.cache_type,
        "prefix_cache_policy": config.prefix_cache_policy,
        "page_size": config.page_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "chunked_prefill_size": config.chunked_prefill_size,
        **runner.memory_info(),  # bytes of weights and pools, free memory: start-up summary
    }
