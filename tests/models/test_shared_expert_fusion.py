"""A MoE block's shared expert fused into its routed experts (`layers.common.fuse_shared_expert`:
expert E of the stack, routed to every token with its gate's sigmoid or one as weight) computes
the unfused block: on CPU in fp32, the same greedy tokens and prompt log-probabilities to
rounding; where the two differ in form, nothing is fused."""

from __future__ import annotations

import pytest
import torch

PROMPTS = [[1, 5, 9, 2, 7, 3], [11, 4, 4, 8], list(range(20, 57))]


def greedy(path: str, n: int = 10) -> tuple[list[list[int]], list[torch.Tensor]]:
    from deltaserve import LLM
    from deltaserve.engine.requests.sampling_params import SamplingParams

    llm = LLM(model=path, device="cpu", dtype="float32")
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=n, temperature=0, prompt_logprobs=0), use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs], [
        torch.tensor([lp.logprob for lp in o.prompt_logprobs[1:]]) for o in outs
    ]


def assert_fusion_changes_nothing(path: str, fuse_on_cpu, blocks: int) -> None:
    tokens, logprobs = greedy(path)
    counts = fuse_on_cpu()
    fused_tokens, fused_logprobs = greedy(path)
    assert counts == [blocks]
    assert fused_tokens == tokens
    for a, b in zip(fused_logprobs, logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_qwen_fused_shared_expert_changes_nothing(kind, make_checkpoint, fuse_on_cpu):
    assert_fusion_changes_nothing(make_checkpoint(kind), fuse_on_cpu, blocks=4)  # every layer's MoE


@pytest.mark.slow
@pytest.mark.parametrize("groups", [2, 1])  # the torch grouped routing; the one-group rule of the kernel
def test_kimi_fused_shared_expert_changes_nothing(groups, kimi_builder, kimi_config, tmp_path, fuse_on_cpu):
    config = {**kimi_config, "n_group": groups}
    kimi_builder(str(tmp_path), config)
    blocks = config["num_hidden_layers"] - config.get("first_k_dense_replace", 1)
    assert_fusion_changes_nothing(str(tmp_path), fuse_on_cpu, blocks)


def _block(shared_size: int):
    from deltaserve.models.layers.common import SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(32, 8, 2, 16, shared_size, norm_topk_prob=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block


def test_block_fuses_its_shared_expert_as_expert_e(monkeypatch):
    monkeypatch.setenv("DELTASERVE_SHARED_EXPERT_TOKENS", "4")
    block = _block(16)
    x = torch.randn(5, 32)
    want = block(x)
    shared_gate_up = block.shared_expert.gate_up_proj.weight.clone()
    assert block.fuse_shared_expert()
    assert block.experts.gate_up_proj.shape[0] == 9 and block.fused_max_tokens == 4
    assert torch.equal(block.experts.gate_up_proj[8], shared_gate_up)
    # the router's 9 rows (8 experts, the shared gate) padded with zeros to 16, aligned for cuBLAS
    assert block.gate.weight.shape[0] == 16 and not block.gate.weight[9:].any()
    # the shared MLP's weights are views of the stack's expert E, not a second copy
    assert block.shared_expert.gate_up_proj.weight.data_ptr() == block.experts.gate_up_proj[8].data_ptr()
    torch.testing.assert_close(block(x[:4]), want[:4], rtol=0, atol=1e-6)  # one routed-MoE call
    # past the limit the shared MLP runs apart, gated by the router's last logit: as unfused
    assert torch.equal(block(x), want)


def test_shared_expert_tokens_setting(monkeypatch):
    from deltaserve.models.layers.common import fused_shared_max_tokens

    assert fused_shared_max_tokens() == 512
    monkeypatch.setenv("DELTASERVE_SHARED_EXPERT_TOKENS", "0")
    assert fused_shared_max_tokens() == 0
    monkeypatch.setenv("DELTASERVE_SHARED_EXPERT_TOKENS", "many")
    with pytest.raises(ValueError, match="DELTASERVE_SHARED_EXPERT_TOKENS"):
        fused_shared_max_tokens()


def test_shared_expert_of_another_width_stays_apart():
    block = _block(32)
    x = torch.randn(5, 32)
    want = block(x)
    assert not block.fuse_shared_expert()
    assert block.fused_max_tokens is None and block.experts.gate_up_proj.shape[0] == 8
    assert torch.equal(block(x), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe", "kimi"])
def test_cuda_fused_shared_experts_change_nothing(
    kind, make_checkpoint, kimi_builder, kimi_config, tmp_path, monkeypatch
):
    """On CUDA the loader fuses the shared experts (the router kernel's shared column, the fused
    MoE's expert E): fp32 greedy tokens as with them apart. Kimi with one expert group, whose
    routing is the kernel's."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.models.checkpoints import loader

    if kind == "kimi":
        path = str(tmp_path)
        kimi_builder(path, {**kimi_config, "n_group": 1})
    else:
        path = make_checkpoint(
            kind, hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32
        )
    g = torch.Generator().manual_seed(7)
    ps = [
        {"prompt_token_ids": torch.randint(0, 150, (n,), generator=g).tolist()} for n in (3, 17, 40, 90, 130)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run() -> tuple[list[list[int]], bool]:
        llm = LLM(path, device="cuda", dtype="float32", chunked_prefill_size=64)
        fused = any(getattr(m, "fused_max_tokens", None) for m in llm.engine.runner.model.modules())
        return [o.outputs[0].token_ids for o in llm.generate(ps, params)], fused

    ours, fused = run()
    monkeypatch.setattr(loader, "SHARED_EXPERT_FUSION", ())
    apart, not_fused = run()
    assert fused and not not_fused
    same = sum(x == y for x, y in zip(ours, apart))
    print(f"{kind}, shared experts fused, fp32 on CUDA: {same}/{len(ps)} prompts as with them apart")
    assert same >= len(ps) - 1
