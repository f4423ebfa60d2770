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


def test_asked_ids_need_logprobs_and_the_vocabulary() -> None:
    with pytest.raises(InvalidParamError, match="needs logprobs"):
        SamplingParams(logprob_token_ids=[1])
    with pytest.raises(InvalidParamError, match="outside the vocabulary"):
        SamplingParams(logprobs=0, logprob_token_ids=[1, 500]).check_vocab(160)


def test_asked_ids_are_as_many_as_top_logprobs_at_most() -> None:
    """Every scored position (each prompt position, with prompt logprobs) reports the asked ids'
    values, built on the engine's thread: a vocabulary's worth stalled every other request."""
    SamplingParams(prompt_logprobs=0, logprob_token_ids=list(range(20)))
    with pytest.raises(InvalidParamError, match="at most 20 token ids") as refused:
        SamplingParams(prompt_logprobs=0, logprob_token_ids=list(range(21)))
    assert refused.value.param == "logprob_token_ids"


def test_generated_tokens_take_vllms_128_asked_ids() -> None:
    """vLLM's bound where only generated tokens report them (one logits row a step)."""
    SamplingParams(logprobs=0, logprob_token_ids=list(range(128)))
    with pytest.raises(InvalidParamError, match="at most 128 token ids") as refused:
        SamplingParams(logprobs=0, logprob_token_ids=list(range(129)))
    assert refused.value.param == "logprob_token_ids"
