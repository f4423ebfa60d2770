"""Log-probabilities of chosen token ids at every position (SamplingParams.logprob_token_ids,
SGLang's token_ids_logprob), fp32 on CPU: those of transformers' next-token distribution, at the
prompt's positions and the output's, through chunked prefill and speculative windows alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.errors import InvalidParamError

ASKED = [3, 50, 7, 120]

_IN_SUBPROCESS = """
import json, sys
sys.modules["fla"] = None  # transformers' torch paths, as on a machine without CUDA
sys.path.insert(0, sys.argv[1])
import test_token_ids_logprob as t
print(json.dumps(t.hf_logprobs(*json.load(sys.stdin))))
"""


def hf_logprobs(path: str, tokens: list[int]) -> list[list[float]]:
    """transformers' log-probabilities of ASKED after each prefix of `tokens`."""
    if torch.cuda.is_available():  # transformers binds FLA's CUDA-only kernels where it can import them
        done = subprocess.run(
            [sys.executable, "-c", _IN_SUBPROCESS, os.path.dirname(os.path.abspath(__file__))],
            input=json.dumps([path, tokens]),
            capture_output=True, text=True, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )  # fmt: skip
        return json.loads(done.stdout.strip().splitlines()[-1])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    return logprobs[:, ASKED].tolist()


@pytest.mark.parametrize(
    "spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}]
)
def test_asked_logprobs_are_transformers(make_checkpoint, spec) -> None:
    path = make_checkpoint("qwen3_5")
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 160, (150,), generator=g).tolist()  # most tokens: one-token lookups match
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        chunked_prefill_size=16,
        max_model_len=256,
        speculative_config=spec,
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        ignore_eos=True,
        logprobs=1,
        prompt_logprobs=0,
        logprob_token_ids=ASKED,
        prompt_logprob_token_ids=ASKED,
    )
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    tokens = prompt + out.outputs[0].token_ids
    ref = hf_logprobs(path, tokens)
    got_prompt = [list(lp.asked.values()) for lp in out.prompt_logprobs[1:]]  # type: ignore[union-attr]
    got_output = [list(lp.asked.values()) for lp in out.outputs[0].logprobs]  # type: ignore[union-attr]
    assert all(list(lp.asked) == ASKED for lp in out.outputs[0].logprobs)  # type: ignore[union-attr]
    torch.testing.assert_close(
        torch.tensor(got_prompt), torch.tensor(ref[: len(prompt) - 1]), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        torch.tensor(got_output), torch.tensor(ref[len(prompt) - 1 : len(tokens) - 1]), atol=1e-4, rtol=0
    )
    if spec is not None:
        assert llm.engine.stats()["spec_draft_tokens_total"] > 0


def test_asked_ids_need_where_they_are_reported_and_the_vocabulary() -> None:
    """vLLM's: logprob_token_ids alone reports them at generated tokens (logprobs 0);
    prompt_logprob_token_ids are reported in prompt_logprobs only, so they need it."""
    assert SamplingParams(logprob_token_ids=[1]).logprobs == 0
    with pytest.raises(InvalidParamError, match="needs prompt_logprobs") as refused:
        SamplingParams(prompt_logprob_token_ids=[1])
    assert refused.value.param == "prompt_logprob_token_ids"
    with pytest.raises(InvalidParamError, match="outside the vocabulary"):
        SamplingParams(logprobs=0, logprob_token_ids=[1, 500]).check_vocab(160)
    with pytest.raises(InvalidParamError, match="outside the vocabulary") as refused:
        SamplingParams(prompt_logprobs=0, prompt_logprob_token_ids=[1, 500]).check_vocab(160)
    assert refused.value.param == "prompt_logprob_token_ids"


def test_prompt_asked_ids_are_as_many_as_top_logprobs_at_most() -> None:
    """Every prompt position reports prompt_logprob_token_ids' values, built on the engine's
    thread: vLLM's max_logprobs bounds them, and refuses an empty list or duplicates."""
    SamplingParams(prompt_logprobs=0, prompt_logprob_token_ids=list(range(20)))
    for ids, words in (
        ([], "must not be empty"),
        (list(range(21)), "at most 20 token ids"),
        ([3, 3], "duplicates"),
    ):
        with pytest.raises(InvalidParamError, match=words) as refused:
            SamplingParams(prompt_logprobs=0, prompt_logprob_token_ids=ids)
        assert refused.value.param == "prompt_logprob_token_ids"


def test_generated_tokens_take_vllms_128_asked_ids() -> None:
    """vLLM's bound where only generated tokens report them (one logits row a step)."""
    SamplingParams(logprobs=0, logprob_token_ids=list(range(128)))
    SamplingParams(prompt_logprobs=0, logprob_token_ids=list(range(128)))  # the prompt's are apart
    with pytest.raises(InvalidParamError, match="at most 128 token ids") as refused:
        SamplingParams(logprobs=0, logprob_token_ids=list(range(129)))
    assert refused.value.param == "logprob_token_ids"


def test_each_field_asks_at_its_own_positions_only(make_checkpoint) -> None:
    """vLLM's split: logprob_token_ids at generated tokens only (so 128 of them with
    prompt_logprobs), prompt_logprob_token_ids at prompt positions only; each used to be both."""
    llm = LLM(make_checkpoint("qwen3_5"), dtype="float32", device="cpu", max_model_len=256)
    prompt = {"prompt_token_ids": [5, 9, 17, 3, 88, 41]}
    greedy = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, "prompt_logprobs": 0}
    wide = list(range(128))
    out = llm.generate([prompt], SamplingParams(**greedy, logprob_token_ids=wide), use_tqdm=False)[0]
    assert [list(lp.asked) for lp in out.outputs[0].logprobs] == [wide] * 3  # type: ignore[union-attr]
    assert all(lp.asked == {} for lp in out.prompt_logprobs[1:])  # type: ignore[union-attr]
    only = SamplingParams(**greedy, prompt_logprob_token_ids=ASKED)
    out = llm.generate([prompt], only, use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None
    assert [list(lp.asked) for lp in out.prompt_logprobs[1:]] == [ASKED] * 5  # type: ignore[union-attr]
