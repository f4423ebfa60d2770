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
