"""`LLM.generate` without sampling parameters uses the checkpoint's generation_config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deltaserve import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 9, 17, 3, 88]}, {"prompt_token_ids": list(range(40, 70))}]


@pytest.mark.slow
def test_generate_without_params_takes_the_generation_config(make_checkpoint, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(make_checkpoint("qwen3_next"), model)
    config_path = model / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update({"temperature": 0.0, "top_k": 20, "max_new_tokens": 5})
    config_path.write_text(json.dumps(config))
    llm = LLM(str(model), dtype="float32", device="cpu")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens, defaults.top_p) == (0.0, 20, 5, 1.0)
    plain = llm.generate(PROMPTS)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in greedy]
    assert all(len(o.outputs[0].token_ids) == 5 or o.outputs[0].finish_reason == "stop" for o in plain)
    # vLLM's generation_config="vllm": OpenAI's defaults, the file left aside
    openai_defaults = LLM(str(model), dtype="float32", device="cpu", generation_config="vllm")
    assert openai_defaults.get_default_sampling_params().max_tokens == SamplingParams().max_tokens


def test_vllms_keyword_arguments_set_their_engine_fields(make_checkpoint) -> None:
    """A vLLM script's LLM(...) runs: vLLM's names for the engine's settings are taken, the ones
    that ask for what deltaserve always does change nothing, and an fp8 KV cache is refused."""
    from deltaserve.engine.llm_arguments import engine_kwargs

    kwargs, source = engine_kwargs(
        {
            "gpu_memory_utilization": 0.5,
            "max_num_seqs": 8,
            "block_size": 32,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "trust_remote_code": True,
            "kv_cache_dtype": "auto",
            "pipeline_parallel_size": 1,
            "distributed_executor_backend": "mp",
            "generation_config": "vllm",
            "dtype": "float32",
        }
    )
    assert kwargs == {
        "mem_fraction_static": 0.5,
        "max_running_requests": 8,
        "page_size": 32,
        "disable_cuda_graph": True,
        "cache_type": "naive",
        "dtype": "float32",
    }
    assert source == "vllm"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_kwargs({"kv_cache_dtype": "fp8"})
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        engine_kwargs({"pipeline_parallel_size": 2})
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        engine_kwargs({"distributed_executor_backend": "ray"})
    with pytest.raises(ValueError, match="not both"):
        engine_kwargs({"max_num_seqs": 8, "max_running_requests": 4})
    llm = LLM(
        make_checkpoint("qwen3_next"),
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    assert llm.engine.config.max_running_requests == 4 and llm.engine.config.cache_type == "naive"
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
