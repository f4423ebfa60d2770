"""The offline `LLM`'s arguments in vLLM's names: its keyword arguments as EngineConfig's fields
(vLLM's spellings, defaults and no-ops taken; what deltaserve lacks refused by name), its
settings' errors named as the caller wrote them, and generate's adapter and tokenization
arguments."""

from __future__ import annotations

import dataclasses
import logging
import numbers
from typing import Any

import numpy as np

from deltaserve.engine.config import EngineConfig, SettingError

logger = logging.getLogger(__name__)

# vLLM's LLM keyword arguments under their EngineConfig names (the command line takes the same)
_RENAMED = {
    "gpu_memory_utilization": "mem_fraction_static",
    "max_num_seqs": "max_running_requests",
    "block_size": "page_size",
    "enforce_eager": "disable_cuda_graph",
}
# vLLM's that ask for what deltaserve always does: accepted, changing nothing
_ALWAYS = ("trust_remote_code", "enable_chunked_prefill", "disable_log_stats")
# vLLM's that tune machinery deltaserve does not have (none changes a result): accepted with a
# warning, once a process, that they are ignored
_IGNORED = {
    "swap_space": "a preempted request is recomputed, never swapped to CPU memory",
    "max_seq_len_to_capture": "CUDA graphs are captured by decode batch size (cuda_graph_max_bs)",
    "disable_custom_all_reduce": "tensor-parallel reductions are torch.distributed's, no custom kernel",
    "disable_async_output_proc": "there is no asynchronous output processor (see enable_overlap_schedule)",
    "compilation_config": "the model runs deltaserve's own kernels, never torch.compile",
}
# vLLM's whose meaning deltaserve has for these values alone: (values taken, why others are refused)
_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "tokenizer_mode": (("auto", "hf"), "the checkpoint's tokenizer loads one way (transformers' fast one)"),
    "cpu_offload_gb": ((0,), "offloading weights to CPU memory is not implemented"),
    "task": (("auto", "generate"), "only text generation is implemented"),
    "runner": (("auto", "generate"), "only text generation is implemented"),
}
_warned: set[str] = set()


def _vllm_dtype(dtype: Any) -> Any:
    """A torch.dtype as EngineConfig's name (which takes vLLM's "half" and "float" itself)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return dtype


def engine_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`LLM`'s keyword arguments as EngineConfig's fields, vLLM's names taken too; and its
    `generation_config` ("auto": the checkpoint's defaults, "vllm" or "none": OpenAI's, or a
    folder holding a generation_config.json). A TypeError names an argument neither takes."""
    out = {k: v for k, v in kwargs.items() if k not in _ALWAYS}
    for name in _IGNORED.keys() & out.keys():
        out.pop(name)
        if name not in _warned:
            _warned.add(name)
            logger.warning("%s is ignored: %s", name, _IGNORED[name])
    for name, (taken, why) in _ONLY.items():
        if name in out and out.pop(name) not in taken:
            raise ValueError(f"{name} {kwargs[name]!r}: only {' or '.join(map(repr, taken))}; {why}")
    if "dtype" in out:
        out["dtype"] = _vllm_dtype(out["dtype"])
    if "seed" in out and out["seed"] is None:
        out["seed"] = 0  # vLLM's engine takes no seed as 0 (its workers must draw alike)
    for vllm_name, name in _RENAMED.items():
        if vllm_name in out and out[vllm_name] is None:  # vLLM's None: its default, as ours
            del out[vllm_name]
        if vllm_name in out:
            if name in out:
                raise ValueError(f"give {vllm_name} or {name}, not both")
            out[name] = out.pop(vllm_name)
    memory = out.pop("kv_cache_memory_bytes", None)
    if memory is not None:  # vLLM's KV cache holds a hybrid model's states too, as these pools do
        if isinstance(memory, bool) or not isinstance(memory, numbers.Integral):
            raise SettingError("kv_cache_memory_bytes", f"must be an integer, got {memory!r}")
        if memory <= 0:  # checked here: pool_memory_gb's own check would name it, in GiB
            raise SettingError("kv_cache_memory_bytes", f"must be positive, got {memory}")
        if "pool_memory_gb" in out:
            raise ValueError("give kv_cache_memory_bytes or pool_memory_gb, not both")
        out["pool_memory_gb"] = memory / 2**30
    caching = out.pop("enable_prefix_caching", None)
    if caching is not None and not isinstance(caching, (bool, np.bool_)):  # "False" would be truthy
        raise SettingError("enable_prefix_caching", f"must be True or False, got {caching!r}")
    if caching is not None:  # vLLM's None: its default, on
        out.setdefault("cache_type", "radix" if caching else "naive")
    if out.pop("pipeline_parallel_size", 1) not in (1, None):
        raise ValueError(
            "pipeline_parallel_size: only 1, pipeline parallelism is not implemented "
            "(split the model over more ranks with tensor_parallel_size)"
        )
    backend = out.pop("distributed_executor_backend", "mp")
    if backend not in ("mp", None):
        raise ValueError(f"distributed_executor_backend {backend!r}: only 'mp' (a process per rank)")
    kv_cache_dtype = out.pop("kv_cache_dtype", "auto")
    if kv_cache_dtype not in ("auto", None):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: only 'auto' (the model's dtype) is implemented")
    source = str(out.pop("generation_config", "auto"))
    unknown = sorted(out.keys() - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
    return out, source


def as_given(error: SettingError, kwargs: dict[str, Any]) -> SettingError:
    """`error` naming its setting as `kwargs`, the caller's arguments, spelled it: vLLM's name
    where that was given, else unchanged."""
    for given, name in _RENAMED.items():
        if name == error.setting and kwargs.get(given) is not None:
            return SettingError(given, error.problem)
    return error


def no_adapter(lora_request: Any, prompt_adapter_request: Any = None) -> None:
    """vLLM's `lora_request` (one, or one a prompt) and older `prompt_adapter_request`: None runs the
    base model, as there; an adapter is refused by name rather than run without it."""
    given = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
    if any(r is not None for r in given):
        raise ValueError("lora_request: LoRA adapters are not implemented; the model runs its own weights")
    if prompt_adapter_request is not None:
        raise ValueError("prompt_adapter_request: prompt adapters are not implemented")


def special_tokens_option(tokenization_kwargs: dict[str, Any] | None, default: bool) -> bool:
    """vLLM's `tokenization_kwargs`, overrides for `tokenizer.encode`: `add_special_tokens` is taken;
    another key is a ValueError naming it (a prompt's last k tokens: `truncate_prompt_tokens`)."""
    kwargs = dict(tokenization_kwargs or {})
    value = kwargs.pop("add_special_tokens", default)
    if kwargs:
        raise ValueError(
            f"tokenization_kwargs {sorted(kwargs)}: only 'add_special_tokens' is taken "
            "(to keep a prompt's last k tokens, SamplingParams(truncate_prompt_tokens=k))"
        )
    if not isinstance(value, bool):
        raise ValueError(f"tokenization_kwargs['add_special_tokens'] must be a bool, got {value!r}")
    return value
