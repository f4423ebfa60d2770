"""Kimi-Linear: greedy tokens identical to transformers (CPU, fp32), every checkpoint spelling.

The tiny model has MLA layers at 1 and 3 (transformers' default pattern puts none in four
layers), a dense first MLP, grouped sigmoid routing with a random correction bias, and
random norms and gates so that every weight reaches the output. Three checkpoints hold the
same weights: as `save_pretrained` writes them (release tensor names, transformers' config),
in transformers' in-memory names (fused experts, one conv, `forget_gate.`), and in the
release's spelling throughout (`linear_attn_config` with 1-based lists, `first_k_dense_replace`).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from deltaserve import LLM, SamplingParams

NEW_TOKENS = 8
LENGTHS = [1, 2, 17, 31, 32, 33, 64, 65, 100, 129, 200]
# the release's config.json spelling of the same model
RELEASE_KEYS = dict(
    num_experts=8,
    num_experts_per_token=3,
    num_expert_group=2,
    topk_group=1,
    num_shared_experts=1,
    moe_renormalize=True,
    moe_router_activation_func="sigmoid",
    use_grouped_topk=True,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    mla_use_nope=True,
    linear_attn_config={
        "kda_layers": [1, 3],
        "full_attn_layers": [2, 4],
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, kimi_builder, kimi_config) -> dict[str, str]:
    import transformers as T
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("kimi")
    saved, hf_names, release = (str(root / n) for n in ("saved", "hf_names", "release"))
    model = kimi_builder(saved, kimi_config, correction_bias=True)
    # transformers' in-memory names
    os.makedirs(hf_names)
    shutil.copy(os.path.join(saved, "config.json"), hf_names)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, os.path.join(hf_names, "model.safetensors"))
    # the release's spelling: save_pretrained already writes its tensor names; rewrite the config
    shutil.copytree(saved, release)
    with open(os.path.join(saved, "config.json")) as f:
        cfg = json.load(f)
    for key in (
        "layer_types",
        "mlp_layer_types",
        "linear_num_heads",
        "linear_head_dim",
        "linear_conv_kernel_dim",
    ):
        cfg.pop(key)
    cfg.update(RELEASE_KEYS)
    with open(os.path.join(release, "config.json"), "w") as f:
        json.dump(cfg, f)
    # transformers reads the release config as the same model
    reread = T.AutoConfig.from_pretrained(release)
    assert (
        reread.layer_types == kimi_config["layer_types"]
        and reread.mlp_layer_types == model.config.mlp_layer_types
    )
    return {"saved": saved, "hf_names": hf_names, "release": release}


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(checkpoints, kimi_config) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, transformers' greedy continuations), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints["saved"], dtype=torch.float32).eval()
    vocab = kimi_config["vocab_size"]
    prompts = random_prompts(vocab, LENGTHS, seed=5)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=vocab - 1,
        )
        outs.append(gen[0, len(p) :].tolist())
    assert len({tuple(o) for o in outs}) > len(outs) // 2, "degenerate model: outputs barely differ"
    return prompts, outs


def generate(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=512, **kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    return [o.outputs[0].token_ids for o in outs], llm


def assert_idle(llm: LLM) -> None:
    s = llm.engine.stats()
    assert (s["running"], s["waiting"], s["state_slots_used"]) == (0, 0, 0), s
    if llm.engine.config.cache_type == "naive":
        assert s["kv_pages_used"] == 0, s


@pytest.mark.parametrize("spelling", ["saved", "hf_names", "release"])
def test_greedy_matches_transformers(spelling, checkpoints, reference):
    prompts, expected = reference
    ours, llm = generate(checkpoints[spelling], prompts, chunked_prefill_size=32, max_running_requests=6)
    assert ours == expected
    assert_idle(llm)
    model = llm.engine.runner.model
    assert model.kv_shapes() == {"latent": (16 + 8,)}  # the compressed latent, not per-head K and V
    assert model.state_shapes() == {"conv": (3 * 32, 3), "recurrent": (2, 16, 16)}


def test_prefix_cache_hits_match(checkpoints, reference):
    """The same prompts again through the radix cache: the second pass starts from snapshots."""
    prompts, expected = reference
    prompts, expected = prompts[-4:], expected[-4:]
    llm = LLM(
        checkpoints["saved"],
        dtype="float32",
        device="cpu",
        max_model_len=512,
        chunked_prefill_size=64,
        cache_type="radix",
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats()["cached_tokens_total"] > 0
    assert_idle(llm)


def _rewrite(src: str, dst: str, edit) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_missing_tensor_is_named(checkpoints, tmp_path):
    name = "model.layers.2.self_attn.v_conv1d.weight"
    path = _rewrite(checkpoints["saved"], str(tmp_path / "m"), lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"v_conv1d|conv1d_weight"):
        LLM(path, dtype="float32", device="cpu", max_model_len=512)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    path = _rewrite(checkpoints["saved"], str(tmp_path / "m2"), lambda t: t.pop(name))
    with pytest.raises(ValueError, match="kv_b_proj"):
        LLM(path, dtype="float32", device="cpu", max_model_len=512)


def test_misshapen_tensor_is_named(checkpoints, tmp_path):
    name = "model.layers.3.block_sparse_moe.gate.e_score_correction_bias"

    def edit(t):
        t[name] = torch.zeros(7)

    path = _rewrite(checkpoints["saved"], str(tmp_path / "m"), edit)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        LLM(path, dtype="float32", device="cpu", max_model_len=512)


@pytest.mark.parametrize("spelling", ["saved", "release"])
def test_hf_overrides_can_lower_the_layer_count(spelling, checkpoints, kimi_config, tmp_path) -> None:
    """`--hf-overrides '{"num_hidden_layers": 2}'` builds the checkpoint's first two layers (a KDA
    and an MLA layer, the dense MLP then experts), as transformers does with that config; the
    other layers' tensors in the files are skipped."""
    from transformers import AutoModelForCausalLM

    short = AutoModelForCausalLM.from_pretrained(
        checkpoints["saved"],
        dtype=torch.float32,
        num_hidden_layers=2,
        layer_types=kimi_config["layer_types"][:2],
        mlp_layer_types=["dense", "sparse"],
    ).eval()
    prompts = random_prompts(kimi_config["vocab_size"], [5, 40], seed=9)
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = short.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=kimi_config["vocab_size"] - 1,
        )  # fmt: skip
        want.append(gen[0, len(p) :].tolist())
    got, llm = generate(checkpoints[spelling], prompts, hf_overrides={"num_hidden_layers": 2})
    assert len(llm.engine.runner.model.model.layers) == 2
    assert got == want
    if spelling == "saved":  # layer_types is given, and shorter than the layers asked for
        with pytest.raises(ValueError, match="layer_types names 4 layers"):
            LLM(checkpoints[spelling], dtype="float32", device="cpu", hf_overrides={"num_hidden_layers": 6})
