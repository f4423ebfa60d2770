"""lm-evaluation-harness against the server, as users run it: its `local-completions` model on a
multiple-choice task (log-likelihoods from echoed prompt log-probabilities) and a generate-until
task, both local (tests/data/lm_eval)."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

DATA = Path(__file__).resolve().parents[2] / "data" / "lm_eval"

CHOICE = """task: deltaserve_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/tiny_choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN = """task: deltaserve_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/tiny_gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow
def test_lm_eval_scores_and_generates(server, builtin_path: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    (tmp_path / "choice.yaml").write_text(CHOICE.format(data=DATA))
    (tmp_path / "gen.yaml").write_text(GEN.format(data=DATA))
    args = (
        f"base_url={server.url}/v1/completions,model={MODEL_NAME},tokenizer={builtin_path},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,max_retries=1"
    )
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=["deltaserve_tiny_choice", "deltaserve_tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    assert 0.0 <= out["results"]["deltaserve_tiny_choice"]["acc,none"] <= 1.0
    assert 0.0 <= out["results"]["deltaserve_tiny_gen"]["exact_match,none"] <= 1.0

    # each choice's log-likelihood is the sum of its tokens' prompt log-probabilities, as the
    # offline engine scores the same tokens (split as the harness splits them: the whole text
    # encoded, the context's tokens first; the choice follows a one-space delimiter)
    from transformers import AutoTokenizer

    from deltaserve import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(builtin_path)
    llm = LLM(model=builtin_path, dtype="float32", device="cpu", max_model_len=512)
    for sample in out["samples"]["deltaserve_tiny_choice"]:
        question = sample["doc"]["question"]
        context = tok.encode(question, add_special_tokens=False)
        for choice, ((got, _),) in zip(sample["doc"]["choices"], sample["resps"]):
            cont = tok.encode(f"{question} {choice}", add_special_tokens=False)[len(context) :]
            (ref,) = llm.generate(
                [{"prompt_token_ids": context + cont}], SamplingParams(max_tokens=0, prompt_logprobs=0)
            )
            assert ref.prompt_logprobs is not None
            want = sum(lp.logprob for lp in ref.prompt_logprobs[len(context) :] if lp is not None)
            assert math.isfinite(got) and math.isclose(got, want, abs_tol=1e-3)

    # generate-until: the server's greedy text up to the stop
    for sample in out["samples"]["deltaserve_tiny_gen"]:
        (got,) = sample["resps"][0]
        direct = httpx.post(
            f"{server.url}/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": sample["doc"]["question"],
                "max_tokens": 8,
                "temperature": 0,
                "stop": ["\n"],
            },
            timeout=60,
        ).json()["choices"][0]["text"]
        assert got == direct
