"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) against transformers' log-softmax,
computed in the prefill (over chunks, beside other requests), with the prefix cache and without."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams


def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) for i >= 1, from transformers in fp32 on CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], lp


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU oracle (FLA hidden); GPU runs keep their own")
@pytest.mark.parametrize("cache_type", ["radix", "naive"])
def test_prompt_logprobs_match_transformers(make_checkpoint, cache_type: str) -> None:
    path = make_checkpoint("qwen3_5")
    llm = LLM(model=path, dtype="float32", device="cpu", chunked_prefill_size=16, cache_type=cache_type)
    prompt = [(13 * i + 5) % 150 + 1 for i in range(45)]  # three chunks of 16
    other = [(7 * i + 3) % 150 + 1 for i in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4)
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    # twice, the second after the first is cached: a hit must not cost any prompt log-probability
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], [params, plain])
        got = outs[0].prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        assert outs[1].prompt_logprobs is None
        want, full = hf_prompt_logprobs(path, prompt)
        assert [lp.token_id for lp in got[1:]] == prompt[1:]
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got[1:]]), want, atol=1e-4, rtol=1e-4)
        for i, lp in enumerate(got[1:]):  # the top 4 alternatives of each position
            vals, ids = torch.topk(full[i], 4)
            assert set(lp.top) == set(ids.tolist())
            torch.testing.assert_close(
                torch.tensor(sorted(lp.top.values())), vals.sort().values, atol=1e-4, rtol=1e-4
            )
    # the generated tokens are those of a request that did not ask
    again = llm.generate([{"prompt_token_ids": prompt}], [plain])
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_max_tokens_zero_scores_the_prompt_only(make_checkpoint) -> None:
    llm = LLM(model=make_checkpoint("qwen3_5"), dtype="float32", device="cpu")
    prompt = [11, 42, 7, 99, 3]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 5
    assert all(lp is not None and lp.logprob <= 0 and lp.top == {} for lp in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.slow
def test_a_step_scores_a_bounded_number_of_prompt_positions(make_checkpoint, monkeypatch) -> None:
    """Each scored prompt position is a vocabulary-wide row of logits: one step scores at most
    PROMPT_LOGPROB_STEP_ROWS of them, over every request, and its other prompts' chunks are not
    cut; the log-probabilities and tokens stay those of an unbounded run."""
    import deltaserve.engine.engine as engine_module
    import deltaserve.engine.step.scheduler as scheduler_module

    path = make_checkpoint("qwen3_5")
    prompts = [[(13 * i + 5 * j) % 150 + 1 for i in range(45)] for j in range(1, 4)]
    scored = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    batch = [{"prompt_token_ids": p} for p in prompts]

    def run() -> tuple[list, list[int], list[int]]:
        llm = LLM(model=path, dtype="float32", device="cpu", chunked_prefill_size=64, cache_type="naive")
        rows: list[int] = []
        steps: list[int] = []
        record = engine_module.record_prompt_logprobs

        def counted(plan, starts, logits):
            rows.append(logits.shape[0])
            steps.append(sum(c.num_tokens for c in plan.chunks))
            return record(plan, starts, logits)

        monkeypatch.setattr(engine_module, "record_prompt_logprobs", counted)
        return llm.generate(batch, [scored, scored, plain]), rows, steps

    free, free_rows, _ = run()
    assert max(free_rows) > 16
    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROB_STEP_ROWS", 16, raising=False)
    bounded, rows, steps = run()
    assert max(rows) <= 16 and max(steps) > 16  # the plain prompt's chunks ride along uncut
    assert [o.outputs[0].token_ids for o in bounded] == [o.outputs[0].token_ids for o in free]
    for got, want in zip(bounded[:2], free[:2]):
        assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
        assert [lp.token_id for lp in got.prompt_logprobs[1:]] == [
            lp.token_id for lp in want.prompt_logprobs[1:]
        ]
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in got.prompt_logprobs[1:]]),
            torch.tensor([lp.logprob for lp in want.prompt_logprobs[1:]]),
            atol=1e-4,
            rtol=1e-4,
        )


@pytest.mark.slow
@pytest.mark.parametrize("cache_type", ["radix", "naive"])
def test_n_choices_compute_the_prompt_logprobs_once(make_checkpoint, monkeypatch, cache_type: str) -> None:
    """A prompt's n choices share its prompt logprobs, computed once (each choice computed them
    over the whole prompt): the same values as n=1's, and each choice's tokens and logprobs those
    of its seed alone."""
    import dataclasses

    import deltaserve.engine.engine as engine_module

    path = make_checkpoint("qwen3_5")
    llm = LLM(model=path, dtype="float32", device="cpu", chunked_prefill_size=16, cache_type=cache_type)
    prompt = [(13 * i + 5) % 150 + 1 for i in range(45)]
    rows: list[int] = []
    record = engine_module.record_prompt_logprobs

    def counted(plan, starts, logits):
        rows.append(logits.shape[0])
        return record(plan, starts, logits)

    monkeypatch.setattr(engine_module, "record_prompt_logprobs", counted)
    params = SamplingParams(
        n=4,
        seed=7,
        max_tokens=4,
        logprobs=1,
        prompt_logprobs=3,
        logprob_token_ids=[5, 9],
        prompt_logprob_token_ids=[5, 9],
    )
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    assert sum(rows) == len(prompt) - 1
    singles = [
        llm.generate([{"prompt_token_ids": prompt}], dataclasses.replace(params, n=1, seed=7 + i))[0]
        for i in range(4)
    ]

    def fields(lps: list) -> list:
        return [None if p is None else (p.token_id, p.logprob, p.top, p.rank, p.asked) for p in lps]

    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert all(list(p.asked) == [5, 9] for p in out.prompt_logprobs[1:])  # the warm-up scored them
    assert fields(out.prompt_logprobs) == fields(singles[0].prompt_logprobs)
    assert out.prompt_logprobs == singles[0].prompt_logprobs  # the decoded tokens' too

    def ids(lps: list) -> list:
        return [(p.token_id, p.rank, list(p.top), list(p.asked)) for p in lps]

    def values(lps: list) -> list[float]:
        return [v for p in lps for v in (p.logprob, *p.top.values(), *p.asked.values())]

    for choice, single in zip(out.outputs, singles):
        assert choice.token_ids == single.outputs[0].token_ids
        # decoded beside its siblings or alone: the same ids, values to float rounding (batch-size GEMMs)
        assert ids(choice.logprobs) == ids(single.outputs[0].logprobs)
        assert values(choice.logprobs) == pytest.approx(values(single.outputs[0].logprobs), abs=1e-5)
