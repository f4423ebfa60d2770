"""`--data-parallel-size 2` on two GPUs: each engine on its own GPU, the tokens of one engine."""

from __future__ import annotations

import re

import pytest
import torch

from .test_data_parallel import completions, per_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

CUDA = ("--device", "cuda", "--dtype", "float32", "--max-model-len", "512")


def test_each_replica_runs_on_its_own_gpu_and_gives_one_engines_tokens(spawn_server) -> None:
    one = spawn_server(*CUDA)
    two = spawn_server(*CUDA, "--data-parallel-size", "2")
    log = two.log()
    for rank in (0, 1):
        assert re.search(rf"\[dp{rank}\]: loading the weights of .* onto cuda:{rank}", log), log[-3000:]
    prompts = [f"on the GPU {i}" + " again" * i for i in range(16)]
    assert completions(two.url, prompts, max_tokens=16) == completions(one.url, prompts, max_tokens=16)
    assert min(per_engine(two.url, "prompt_tokens_total")) > 0


def test_an_engine_on_the_second_gpu_gives_the_first_gpus_tokens(builtin_path) -> None:
    """What a data-parallel replica runs on: an engine on cuda:1 with its graphs and Triton kernels
    there, against the same engine on cuda:0."""
    from deltaserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 3 * i]} for i in range(6)]
    runs = []
    for device in ("cuda:0", "cuda:1"):
        llm = LLM(builtin_path, device=device, dtype="float32", max_model_len=256)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert str(llm.engine.device) == device
        del llm
    assert runs[0] == runs[1]
