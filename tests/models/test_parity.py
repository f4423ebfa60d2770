"""Greedy tokens identical to transformers for every checkpoint form (CPU, fp32)."""

from __future__ import annotations

import zlib

import pytest
import torch

from deltaserve import LLM, SamplingParams

LENGTHS = [1, 2, 7, 31, 32, 33, 63, 64, 65, 100, 128, 129, 200, 300]
NEW_TOKENS = 8


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_deltaserve(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", device="cpu", chunked_prefill_size=kwargs.pop("chunk", 64), **kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    return [o.outputs[0].token_ids for o in outs], llm


def assert_idle(llm: LLM) -> None:
    s = llm.engine.stats()
    assert (s["running"], s["waiting"], s["kv_pages_used"], s["state_slots_used"]) == (0, 0, 0, 0), s


@pytest.mark.parametrize(
    "kind",
    [
        "qwen3_next",
        *(pytest.param(k, marks=pytest.mark.slow) for k in ("qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl")),
        "qwen3_5",
    ],
)
def test_greedy_matches_transformers(kind, make_checkpoint, hf_reference):
    path = make_checkpoint(kind)
    prompts = random_prompts(
        160, LENGTHS, seed=zlib.crc32(kind.encode()) % 1000
    )  # hash() of a str changes per process
    ours, llm = run_deltaserve(path, prompts, max_running_requests=8)
    assert ours == hf_reference(path, prompts, NEW_TOKENS)
    assert_idle(llm)


@pytest.mark.slow
def test_small_chunks_and_few_slots_match(make_checkpoint, hf_reference):
    """Chunks of 32 tokens, and more prompts than state slots: requests wait their turn."""
    path = make_checkpoint("qwen3_next")
    prompts = random_prompts(160, [5, 40, 97, 150, 33, 64], seed=7)
    ours, llm = run_deltaserve(path, prompts, chunk=32, max_running_requests=2)
    assert ours == hf_reference(path, prompts, NEW_TOKENS)
    assert_idle(llm)


def test_kv_pressure_preempts_and_still_matches(make_checkpoint, hf_reference):
    """Too few KV pages for all requests at once: decodes preempt, outputs stay exact."""
    path = make_checkpoint("qwen3_next")
    prompts = random_prompts(160, [60, 61, 62, 63], seed=11)
    ours, llm = run_deltaserve(path, prompts, max_running_requests=4, num_kv_pages=12, page_size=16)
    assert ours == hf_reference(path, prompts, NEW_TOKENS)
    assert_idle(llm)


def test_tied_and_sharded_checkpoint(make_checkpoint, hf_reference):
    path = make_checkpoint("qwen3_5", tie_word_embeddings=True, shard=True)
    prompts = random_prompts(160, [3, 70], seed=3)
    ours, _ = run_deltaserve(path, prompts)
    assert ours == hf_reference(path, prompts, NEW_TOKENS)
