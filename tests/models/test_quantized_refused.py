"""A quantized checkpoint that deltaserve does not implement is refused at load with a clear
error, never served as noise (block FP8, the supported one, is tests/models/test_fp8_checkpoints.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.models.checkpoints.loader import read_config

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
UNSUPPORTED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**FP8, "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({**FP8, "weight_block_size": None}, "weight_block_size None"),
    ({**FP8, "fmt": "e5m2"}, "fmt 'e5m2'"),
]


def copy_of(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("quant,why", UNSUPPORTED)
def test_unsupported_quantization_is_refused(quant: dict, why: str, make_checkpoint, tmp_path: Path) -> None:
    path = copy_of(make_checkpoint("qwen3_5"), tmp_path / "ckpt")
    read_config(str(path))  # the plain checkpoint loads
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ValueError, match=f"quantized checkpoint that deltaserve does not implement.*{why}"):
        read_config(str(path))


def test_fp8_weights_without_a_config_are_refused(make_checkpoint, tmp_path: Path) -> None:
    path = copy_of(make_checkpoint("qwen3_5"), tmp_path / "ckpt")
    (file,) = sorted(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    name = next(k for k in sorted(tensors) if k.endswith("proj.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name.replace(".weight", ".weight_scale_inv")] = torch.ones(1, 1)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="quantized weights"):
        read_config(str(path))


def test_the_engine_start_says_why(make_checkpoint, tmp_path: Path) -> None:
    from deltaserve import LLM

    path = copy_of(make_checkpoint("qwen3_5"), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": {"quant_method": "bitsandbytes"}})
    )
    with pytest.raises(ValueError, match="supported: quant_method 'fp8'.*or unquantized"):
        LLM(model=str(path), device="cpu", dtype="float32")
