"""Tensor parallelism on two GPUs (NCCL): with CUDA graphs and overlap scheduling (both on by
default on CUDA), greedy tokens at TP = 2 equal TP = 1, also through a radix hit and n-gram
speculation, and the workers' decode page tables follow rank 0's."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_tp2_on_two_gpus_equals_tp1(make_checkpoint, spec):
    path = make_checkpoint("qwen3_5")
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 160, (96,), generator=g).tolist()
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() * 2 for n in (3, 40, 17, 150)]
    later = [shared + [1], shared + [2, 3]]  # the second hits the first's cached prefix
    kw = dict(dtype="float32", max_model_len=1024, speculative_config=spec)
    with LLM(path, **kw) as llm:
        ref = run(llm, prompts) + run(llm, later[:1]) + run(llm, later[1:])
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        assert llm.engine.runner.graph_runner is not None  # decode by graph replay on rank 0
        got = run(llm, prompts) + run(llm, later[:1]) + run(llm, later[1:])
        ours, theirs = llm.engine.tensor_parallel_digests()
    assert got == ref
    assert torch.equal(ours["page_table"], theirs["page_table"])


def _images_and_mtp_at_tp2(vision_path: str, mtp_path: str, device_kw: dict) -> None:
    """Images (rank 0's tower, embeddings broadcast) and MTP drafts (each rank's shard of the MTP
    layer) at TP = 2 give TP = 1's tokens."""
    from .test_tensor_parallel_engine import image_prompts

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=1024, **device_kw)

    def images(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(image_prompts(), params, use_tqdm=False)]

    with LLM(vision_path, **kw) as llm:
        ref = images(llm)
    with LLM(vision_path, tensor_parallel_size=2, **kw) as llm:
        assert images(llm) == ref
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (5, 70, 33)]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(mtp_path, speculative_config=spec, **kw) as llm:
        ref = run(llm, prompts)
    with LLM(mtp_path, tensor_parallel_size=2, speculative_config=spec, **kw) as llm:
        assert run(llm, prompts) == ref
        assert llm.engine.stats()["spec_draft_tokens_total"] > 0


def test_images_and_mtp_at_tp2_on_two_gpus(make_checkpoint, vision_builder, tmp_path):
    from ..spec_decode.test_spec_mtp import with_mtp

    sizes = dict(hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)
    vision = vision_builder(str(tmp_path / "vl"), **sizes)
    mtp = with_mtp(make_checkpoint("qwen3_5", **sizes), str(tmp_path / "mtp"))
    _images_and_mtp_at_tp2(vision, mtp, {})
