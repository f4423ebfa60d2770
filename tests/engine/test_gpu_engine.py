"""The engine on CUDA in bf16: graphs against eager, agreement with transformers, no leaks."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LENGTHS = [1, 9, 64, 65, 130, 300, 17, 200]


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def greedy(llm: LLM, ps: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_graph_and_eager_decode_identical(kind, make_checkpoint, pools_held):
    path = make_checkpoint(
        kind, hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32
    )
    ps = prompts(160)
    eager = LLM(path, device="cuda", dtype="bfloat16", disable_cuda_graph=True, chunked_prefill_size=64)
    graph = LLM(path, device="cuda", dtype="bfloat16", chunked_prefill_size=64, max_running_requests=16)
    if kind == "qwen3_5":  # dense: every op is capturable
        assert graph.engine.runner.graph_runner is not None
    assert greedy(eager, ps, 24) == greedy(graph, ps, 24)
    assert not pools_held(eager) and not pools_held(graph)


def test_graph_and_eager_decode_identical_at_real_head_sizes(real_heads_checkpoint, pools_held):
    """Decode graphs on Qwen3.5-0.8B's head sizes (the kernels' shapes in the benchmarks), fp32
    so that graph and eager differ in nothing but replay: identical tokens."""
    path = real_heads_checkpoint
    ps = prompts(1024, seed=5)
    kw = dict(device="cuda", dtype="float32", chunked_prefill_size=128, max_running_requests=8)
    eager = LLM(path, disable_cuda_graph=True, **kw)
    graph = LLM(path, **kw)
    assert graph.engine.runner.graph_runner is not None
    assert greedy(eager, ps, 24) == greedy(graph, ps, 24)
    assert graph.engine.runner.graph_runner.decode.replays > 0
    assert not pools_held(eager) and not pools_held(graph)


def test_bf16_agrees_with_transformers(make_checkpoint, hf_reference):
    """bf16 drifts from fp32 on near-ties; the rate of identical first-32-token runs is reported."""
    path = make_checkpoint(
        "qwen3_5", hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32
    )
    ps = prompts(160, seed=1)
    ours = greedy(LLM(path, device="cuda", dtype="bfloat16", chunked_prefill_size=64), ps, 32)
    ref = hf_reference(path, ps, 32)  # fp32 reference
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 32) for x, y in zip(ours, ref)]
    rate = sum(agree) / (32 * len(ps))
    print(f"bf16 vs transformers fp32: {rate:.1%} of the first 32 tokens agree before the first divergence")
    assert all(a >= 1 for a in agree)  # the first token always agrees
    assert rate >= 0.5


def test_fp32_cuda_matches_transformers(make_checkpoint, hf_reference, pools_held):
    path = make_checkpoint(
        "qwen3_5", hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32
    )
    ps = prompts(160, seed=2)
    llm = LLM(path, device="cuda", dtype="float32", chunked_prefill_size=64)
    ours = greedy(llm, ps, 16)
    ref = hf_reference(path, ps, 16)
    same = sum(x == y for x, y in zip(ours, ref))
    print(f"fp32 on CUDA: {same}/{len(ps)} prompts identical to transformers over 16 tokens")
    assert same >= len(ps) - 1
    assert not pools_held(llm)


def test_mixed_workload_leaves_pools_idle(make_checkpoint, pools_held):
    path = make_checkpoint(
        "qwen3_5", hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32
    )
    llm = LLM(path, device="cuda", dtype="bfloat16", chunked_prefill_size=64, max_running_requests=4)
    ps = prompts(160, seed=3) * 3
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=5 + i % 20, ignore_eos=True)
        for i in range(len(ps))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5 + i % 20 for i in range(len(ps))]
    assert not pools_held(llm)


def test_overlap_schedule_identical_with_graphs(make_checkpoint, pools_held):
    """Overlap scheduling on CUDA (pinned copies both ways, events, graph replay fed from the
    device) gives the synchronous engine's tokens, greedy with stops and seeded sampling, and
    leaves the pools idle. fp32, so that the two engines' different batch shapes (a stopped
    request stays one step longer with overlap) cannot flip a near-tie."""
    path = make_checkpoint(
        "qwen3_5", hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32
    )
    ps = prompts(160, seed=4)
    kw = dict(device="cuda", dtype="float32", chunked_prefill_size=64, max_running_requests=8)
    sync = LLM(path, enable_overlap_schedule=False, **kw)
    ref = greedy(sync, ps, 24)
    over = LLM(path, **kw)  # on by default on CUDA
    assert over.engine.config.enable_overlap_schedule
    assert over.engine.runner.graph_runner is not None
    overlapped = []
    fill = over.engine.overlap.fill_placeholders

    def counting_fill(*args):
        overlapped.append(1)  # a step launched while the previous one was in flight
        return fill(*args)

    over.engine.overlap.fill_placeholders = counting_fill  # type: ignore[method-assign]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[r[5]] if i % 2 else []
        )
        for i, r in enumerate(ref)
    ]
    outs = over.generate([{"prompt_token_ids": p} for p in ps], params)
    expected = sync.generate([{"prompt_token_ids": p} for p in ps], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert len(overlapped) > 10 and over.engine.read_back_wait_s > 0
    # sampled rows: per-request temperature / top-k / top-p reach the GPU through pinned copies
    sampled = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True)
        for i in range(len(ps))
    ]
    outs = over.generate([{"prompt_token_ids": p} for p in ps], sampled)
    expected = sync.generate([{"prompt_token_ids": p} for p in ps], sampled)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert not pools_held(over)
