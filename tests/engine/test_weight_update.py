"""Weights updated from disk (SGLang's update_weights_from_disk) in the offline engine, fp32 on
CPU: after the update the engine gives transformers' tokens for the new checkpoint, the prefix
cache the old weights filled is gone, and updating back gives the first tokens again; a
checkpoint of another model, or none, is a ValueError that changes nothing."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from deltaserve import LLM, SamplingParams

NEW = 8


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in lengths]


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(path: str) -> LLM:
    return LLM(
        path, dtype="float32", device="cpu", chunked_prefill_size=32, max_model_len=512, num_kv_pages=120
    )


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_the_new_checkpoint_is_served_and_the_cache_is_dropped(
    kind, make_checkpoint, hf_reference, pools_held
):
    first, second = make_checkpoint(kind), make_checkpoint(kind, seed=1)
    prompts = prompts_of([5, 40, 70], seed=1)
    llm = make_llm(first)
    before = run(llm, prompts)
    assert before == hf_reference(first, prompts, NEW)
    llm.update_weights_from_disk(second)
    after = run(llm, prompts)
    assert after == hf_reference(second, prompts, NEW) and after != before
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the cache serves the new weights' prefixes ...
    llm.update_weights_from_disk(first)
    back = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0]
    assert back.num_cached_tokens == 0  # ... and is dropped with them
    assert run(llm, prompts) == before
    assert not pools_held(llm)


def test_staged_weights_dropped_change_nothing_and_committed_serve(make_checkpoint, hf_reference) -> None:
    """The two halves a data-parallel server runs on each replica: weights staged then dropped
    (another replica refused) leave the engine as it was, cache included; staged then committed,
    they are served."""
    first, second = make_checkpoint("qwen3_5"), make_checkpoint("qwen3_5", seed=1)
    prompts = prompts_of([5, 40, 70], seed=3)
    llm = make_llm(first)
    before = run(llm, prompts)
    assert llm.engine.stage_weights(second) is None
    llm.engine.finish_weights(commit=False)
    assert run(llm, prompts) == before and llm.engine.model_info["model"] == first
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.engine.stage_weights(second) is None
    llm.engine.finish_weights(commit=True, weight_version="two")
    assert run(llm, prompts) == hf_reference(second, prompts, NEW)
    assert llm.engine.model_info["model"] == second and llm.engine.model_info["weight_version"] == "two"


def test_another_models_checkpoint_or_none_changes_nothing(make_checkpoint, tmp_path, pools_held):
    path = make_checkpoint("qwen3_5")
    prompts = prompts_of([5, 40], seed=2)
    llm = make_llm(path)
    before = run(llm, prompts)
    with pytest.raises(ValueError, match="intermediate_size"):
        llm.update_weights_from_disk(make_checkpoint("qwen3_5", intermediate_size=40))
    with pytest.raises(ValueError, match="no checkpoint"):
        llm.update_weights_from_disk(str(tmp_path / "absent"))
    broken = shutil.copytree(path, tmp_path / "broken")
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            (broken / name).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="could not be loaded"):
        llm.update_weights_from_disk(str(broken))
    with pytest.raises(ValueError, match="load format"):
        llm.update_weights_from_disk(path, load_format="gguf")
    assert run(llm, prompts) == before
    assert not pools_held(llm)


def test_a_vision_towers_weights_update_too(vision_checkpoint, tmp_path) -> None:
    """A new tower changes what an image means: the updated engine's tokens for a prompt with an
    image are those of an engine started on the new checkpoint."""
    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file, save_file

    other = shutil.copytree(vision_checkpoint, tmp_path / "other")
    g = torch.Generator().manual_seed(5)
    for name in os.listdir(other):
        if name.endswith(".safetensors"):
            sd = load_file(other / name)
            sd = {
                k: t + 0.3 * torch.randn(t.shape, generator=g) if "visual" in k else t for k, t in sd.items()
            }
            save_file(sd, other / name, metadata={"format": "pt"})
    pixels = np.random.default_rng(1).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    prompt = {
        "prompt_token_ids": [5, 6, 152, 150, 153, 7, 8],
        "multi_modal_data": {"image": [Image.fromarray(pixels)]},
    }
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

    def tokens(llm: LLM) -> list[int]:
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    llm = make_llm(vision_checkpoint)
    before = tokens(llm)
    llm.update_weights_from_disk(str(other))
    assert tokens(llm) == tokens(make_llm(str(other))) != before


def _fresh(path: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=512, **kw)
    return run(llm, prompts)


def test_fused_shared_experts_take_the_new_weights(make_checkpoint, fuse_on_cpu) -> None:
    """Where the loader fuses each shared expert into the routed ones (CUDA; here CPU made to), the
    staged copy is fused alike before it is checked and copied."""
    first, second = make_checkpoint("qwen3_next"), make_checkpoint("qwen3_next", seed=1)
    prompts = prompts_of([6, 33], seed=5)
    counts = fuse_on_cpu()
    llm = make_llm(first)
    llm.update_weights_from_disk(second)
    assert counts == [4, 4]  # the live model and the staged copy, every MoE block
    assert run(llm, prompts) == _fresh(second, prompts)


@pytest.mark.parametrize("online", [False, True], ids=["fp8-checkpoint", "quantized-at-load"])
def test_fp8_weights_update(online: bool, make_checkpoint, tmp_path) -> None:
    """An FP8 checkpoint's new weights and block scales, or a bf16 one quantized as it loads
    (--quantization fp8): what an engine started on the new checkpoint computes."""
    from ..models.test_fp8_checkpoints import SHAPES, write_fp8

    first, second = make_checkpoint("qwen3_5", **SHAPES), make_checkpoint("qwen3_5", seed=1, **SHAPES)
    if not online:
        first, second = str(write_fp8(first, tmp_path / "a")), str(write_fp8(second, tmp_path / "b"))
    kw = {"quantization": "fp8"} if online else {}
    prompts = prompts_of([6, 33], seed=6)
    llm = LLM(first, dtype="float32", device="cpu", max_model_len=512, **kw)
    before = run(llm, prompts)
    llm.update_weights_from_disk(second)
    after = run(llm, prompts)
    assert after == _fresh(second, prompts, **kw) and after != before


def _update_matches_a_fresh_engine(first: str, second: str, device: str) -> None:
    prompts = prompts_of([6, 40, 90], seed=7)
    kw = dict(dtype="float32", device=device, max_model_len=512)
    llm = LLM(first, **kw)
    before = run(llm, prompts)
    llm.update_weights_from_disk(second)
    after = run(llm, prompts)
    assert after == run(LLM(second, **kw), prompts) and after != before
    graphs = llm.engine.runner.graph_runner
    assert device == "cpu" or (graphs is not None and graphs.decode.replays > 0)  # graphs replay new weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_weights_update_on_cuda(kind, make_checkpoint) -> None:
    """On CUDA (decode graphs captured over the old weights; Qwen3-Next's shared experts fused into
    the routed ones), the updated engine computes what one started on the new checkpoint does."""
    sizes = dict(hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)
    _update_matches_a_fresh_engine(
        make_checkpoint(kind, **sizes), make_checkpoint(kind, seed=1, **sizes), "cuda"
    )
