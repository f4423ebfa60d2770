"""A checkpoint whose config scales RoPE (YaRN, as Qwen's cards give it for contexts past the
native length, or position interpolation) runs as transformers runs it: greedy tokens identical
on CPU in fp32, at positions well past the original length; a scaling deltaserve does not
implement is refused at load instead of run as plain RoPE."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams

TEXT = dict(
    vocab_size=160, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, intermediate_size=48, max_position_embeddings=1024,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 3.0}
NEW = 8


VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32)


def build(tmp_path, kind: str, scaling: dict, partial: float, **sizes: int) -> str:
    """A random checkpoint of `kind`; `sizes` replace TEXT's (the CUDA kernels' head sizes)."""
    import transformers as T

    torch.manual_seed(1)
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": partial, **scaling}
    text = {**TEXT, **sizes}
    if kind == "qwen3_5":
        model = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**text, rope_parameters=rope))
    elif kind == "qwen3_5_vl":
        config = T.Qwen3_5Config(text_config={**text, "rope_parameters": rope}, vision_config=VISION)
        model = T.Qwen3_5ForConditionalGeneration(config)
    else:
        model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**text, **MOE, rope_parameters=rope))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(0.0, 0.2)
    path = str(tmp_path / kind)
    model.save_pretrained(path)
    return path


def prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "kind, scaling, partial",
    [
        ("qwen3_5", YARN, 1.0),
        ("qwen3_next", YARN, 0.5),
        pytest.param("qwen3_5", LINEAR, 0.5, marks=pytest.mark.slow),
    ],
)
def test_scaled_rope_matches_transformers(
    tmp_path, hf_reference, kind: str, scaling: dict, partial: float
) -> None:
    path = build(tmp_path, kind, scaling, partial)
    ps = prompts([5, 63, 64, 65, 150, 300])  # past the original 64 positions
    llm = LLM(path, dtype="float32", device="cpu", chunked_prefill_size=64)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ps],
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(path, ps, NEW)
    plain = build(tmp_path / "plain", kind, {}, partial)
    unscaled = LLM(plain, dtype="float32", device="cpu", chunked_prefill_size=64).generate(
        [{"prompt_token_ids": p} for p in ps],
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
    )
    assert [o.outputs[0].token_ids for o in unscaled] != [o.outputs[0].token_ids for o in outs]  # it mattered


def test_a_scaling_deltaserve_does_not_implement_is_refused(tmp_path) -> None:
    path = build(tmp_path, "qwen3_5", {"rope_type": "dynamic", "factor": 2.0}, 1.0)
    with pytest.raises(ValueError, match="RoPE scaling 'dynamic' is not supported"):
        LLM(path, dtype="float32", device="cpu")


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_vl"])
def test_hf_overrides_give_a_plain_checkpoint_the_scaling(tmp_path, hf_reference, kind: str) -> None:
    """vLLM's --hf-overrides: YaRN set on a plain checkpoint's config (inside text_config for the
    vision-language layout) gives transformers' tokens for the same weights saved with YaRN, and
    stretches the longest sequence the model takes to original length x factor."""
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": 1.0, **YARN}
    scaled = build(tmp_path / "scaled", kind, YARN, 1.0)
    plain = build(tmp_path / "plain", kind, {}, 1.0)
    overrides = {"rope_parameters": rope}
    if kind == "qwen3_5_vl":
        overrides = {"text_config": overrides}
    ps = prompts([65, 200])
    llm = LLM(plain, dtype="float32", device="cpu", chunked_prefill_size=64, hf_overrides=overrides)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ps],
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(scaled, ps, NEW)
    longer = {**rope, "original_max_position_embeddings": 1024, "factor": 4.0}
    wide = {"rope_parameters": longer} if kind == "qwen3_5" else {"text_config": {"rope_parameters": longer}}
    stretched = LLM(
        plain, dtype="float32", device="cpu", hf_overrides=wide, max_model_len=3000, num_kv_pages=200
    )
    assert stretched.engine.max_model_len == 3000  # past max_position_embeddings (1024)
    with pytest.raises(ValueError, match="longer than the model's 1024 positions"):
        LLM(plain, dtype="float32", device="cpu", max_model_len=3000, num_kv_pages=200)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, partial", [("qwen3_5", 1.0), ("qwen3_next", 0.5)])
def test_yarn_on_cuda_matches_transformers(tmp_path, hf_reference, kind: str, partial: float) -> None:
    """YaRN through the CUDA path (the fused q/k norm and RoPE kernel given YaRN's frequencies,
    prefill and decode graphs), fp32: transformers' tokens past the original length."""
    sizes = dict(hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)
    path = build(tmp_path, kind, YARN, partial, **sizes)
    ps = prompts([5, 63, 65, 150, 300])
    llm = LLM(path, dtype="float32", device="cuda", chunked_prefill_size=64, max_running_requests=8)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ps],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    )
    ours = [o.outputs[0].token_ids for o in outs]
    ref = hf_reference(path, ps, 16)
    same = sum(x == y for x, y in zip(ours, ref))
    print(f"YaRN fp32 on CUDA ({kind}): {same}/{len(ps)} prompts identical to transformers over 16 tokens")
    assert same >= len(ps) - 1


def test_hf_overrides_can_lower_the_layer_count(tmp_path, hf_reference) -> None:
    """`--hf-overrides '{"num_hidden_layers": 2}'` builds the checkpoint's first two layers, as
    transformers does with that config (a Qwen3-Next config also lists each layer's type); more
    layers than the types name is refused."""
    import transformers as T

    path = build(tmp_path, "qwen3_next", {}, 0.5, full_attention_interval=2)  # both kinds in two layers
    types = T.AutoConfig.from_pretrained(path).layer_types
    short = T.AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=2, layer_types=types[:2])
    short.save_pretrained(tmp_path / "short")
    ps = prompts([5, 40])
    llm = LLM(
        path, dtype="float32", device="cpu", chunked_prefill_size=64, hf_overrides={"num_hidden_layers": 2}
    )
    assert len(llm.engine.runner.model.model.layers) == 2
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ps],
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(str(tmp_path / "short"), ps, NEW)
    with pytest.raises(ValueError, match="layer_types names 4 layers"):
        LLM(path, dtype="float32", device="cpu", hf_overrides={"num_hidden_layers": 6})
