"""The built-in default model: a real Qwen3-Next checkpoint with the Qwen3 tokenizer, built
deterministically and atomically."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME, builtin_model_path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_config_is_a_qwen3_next_gdn_hybrid(builtin_path: str) -> None:
    config = json.loads((Path(builtin_path) / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and config["architectures"] == ["Qwen3NextForCausalLM"]
    assert "linear_attention" in config["layer_types"] and "full_attention" in config["layer_types"]
    assert config["num_experts"] > config["num_experts_per_tok"] > 0
    assert config["eos_token_id"] == 151645 and config["bos_token_id"] == 151643
    assert config["tie_word_embeddings"] is False
    generation = json.loads((Path(builtin_path) / "generation_config.json").read_text())
    assert 151645 in generation["eos_token_id"]
    assert (Path(builtin_path) / "model.safetensors").is_file()


def test_tokenizer_loads_offline_with_chat_template(builtin_path: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(builtin_path)
    config = json.loads((Path(builtin_path) / "config.json").read_text())
    assert len(tok) <= config["vocab_size"]
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<think>", "</think>", "<tool_call>"]) == [
        151645,
        151667,
        151668,
        151657,
    ]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        add_generation_prompt=True,
        enable_thinking=False,
        tokenize=False,
    )
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_build_is_deterministic_and_reused(builtin_path: str, tmp_path: Path) -> None:
    again = Path(builtin_model_path(tmp_path))
    assert again == tmp_path / BUILTIN_NAME
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert sha256(again / name) == sha256(Path(builtin_path) / name), name
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert builtin_model_path(tmp_path) == str(again)  # a second call reuses, never rebuilds
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_concurrent_first_use(tmp_path: Path) -> None:
    code = "import sys; from deltaserve.models.checkpoints.builtin import builtin_model_path; print(builtin_model_path(sys.argv[1]))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == str(tmp_path / BUILTIN_NAME)
    assert [p.name for p in tmp_path.iterdir()] == [BUILTIN_NAME]  # no half-built leftovers
    assert (tmp_path / BUILTIN_NAME / "model.safetensors").is_file()
