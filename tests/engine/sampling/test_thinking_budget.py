"""`SamplingParams.thinking_token_budget` (vLLM's) through the offline LLM on the real Qwen3
tokenizer: the reasoning holds at most the budget's tokens, then `</think>` is forced and the
model answers; nothing changes before the budget is spent, nor for requests without one."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine.errors import InvalidParamError
from deltaserve.engine.sampling.thinking_budget import ThinkingBudget

NEW = 14


@pytest.fixture(scope="module")
def llm(tokenized_checkpoint: str) -> LLM:
    return LLM(tokenized_checkpoint, dtype="float32", device="cpu")


def think_ids(llm: LLM) -> tuple[int, int]:
    start, end = llm.get_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
    return start, end


def opened_prompt(llm: LLM) -> list[int]:
    """Qwen3.5's generation prompt: the assistant's turn opens `<think>`."""
    text = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    return llm.get_tokenizer().encode(text)


def tokens(llm: LLM, prompt: list[int], budget: int | None, **kw) -> list[int]:
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, thinking_token_budget=budget, **kw
    )
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_the_budget_ends_the_reasoning_then_the_model_answers(
    llm, tokenized_checkpoint, hf_reference, budget
):
    """The random model never writes `</think>` within NEW tokens on its own: with budget B the
    reasoning is the unbudgeted output's first B tokens, then `</think>`, then the model's greedy
    answer to the prompt followed by that reasoning and `</think>` (transformers')."""
    _, end = think_ids(llm)
    prompt = opened_prompt(llm)
    free = tokens(llm, prompt, None)
    assert end not in free
    out = tokens(llm, prompt, budget)
    assert out[:budget] == free[:budget]
    assert out[budget] == end
    head = prompt + out[: budget + 1]
    assert out[budget + 1 :] == hf_reference(tokenized_checkpoint, [head], NEW - budget - 1)[0]


def test_unlimited_budgets_change_nothing(llm):
    prompt = opened_prompt(llm)
    free = tokens(llm, prompt, None)
    assert tokens(llm, prompt, -1) == free
    assert tokens(llm, prompt, NEW) == free  # a budget the output never reaches


def test_a_prompt_without_open_reasoning_is_untouched(llm):
    """No `<think>` left open and none written first by the model: the output is no reasoning,
    and even budget 0 forces nothing (a closed `<think></think>` block as enable_thinking=false renders)."""
    tok = llm.get_tokenizer()
    closed = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    for prompt in (closed, plain):
        assert tokens(llm, prompt, 0) == tokens(llm, prompt, None)


def test_the_model_opening_its_own_reasoning_is_counted(llm):
    """Qwen3 writes `<think>` itself: with a bias that makes it write `<think>` at every step, the
    output is `<think>`, the budget's tokens (more `<think>`s, inside reasoning), `</think>`, then
    `<think>` again, which is answer text and forces nothing."""
    start, end = think_ids(llm)
    prompt = llm.get_tokenizer().encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    out = tokens(llm, prompt, 3, logit_bias={start: 100.0})
    assert out == [start] * 4 + [end] + [start] * (NEW - 5)


def test_a_budget_beside_other_requests_in_one_batch(llm):
    """Rows of one batch keep their own state: budgets 2 and 4 and none, sampled together."""
    _, end = think_ids(llm)
    prompt = opened_prompt(llm)
    free = tokens(llm, prompt, None)
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, thinking_token_budget=b)
        for b in (2, None, 4)
    ]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, params, use_tqdm=False)
    two, none, four = (list(o.outputs[0].token_ids) for o in outs)
    assert none == free
    assert two[:2] == free[:2] and two[2] == end
    assert four[:4] == free[:4] and four[4] == end


def test_sampled_requests_are_forced_too(llm):
    _, end = think_ids(llm)
    prompt = opened_prompt(llm)
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=NEW, thinking_token_budget=3)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        ids = list(out.outputs[0].token_ids)
        assert end in ids[:4], ids  # the model may end it earlier, never later


def test_a_mask_that_forbids_the_end_fails_the_request_naming_both(llm):
    _, end = think_ids(llm)
    prompt = opened_prompt(llm)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW, thinking_token_budget=1, allowed_token_ids=[11, 12, 13]
    )
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "error" and c.bad_input
    assert "allowed_token_ids" in c.error and "thinking_token_budget" in c.error
    assert len(c.token_ids) == 1


def test_a_grammar_after_the_reasoning_starts_at_the_forced_end(llm):
    """A grammar that waits for `</think>` (as the server sets it where the prompt opens
    reasoning): the random model never closes its reasoning itself, so without a budget there is
    no JSON; with one the answer after the forced end is the grammar's JSON, and the request ends
    when it is complete."""
    import json

    pytest.importorskip("xgrammar")
    from deltaserve.engine.requests.sampling_params import StructuredOutputs

    _, end = think_ids(llm)
    prompt = opened_prompt(llm)
    spec = StructuredOutputs(
        json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        after_token=end,
    )
    for budget, closes in ((None, False), (4, True)):
        params = SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=spec, thinking_token_budget=budget
        )
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        ids = list(out.outputs[0].token_ids)
        assert (end in ids) == closes
        if closes:
            assert ids.index(end) == budget
            answer = llm.get_tokenizer().decode(ids[budget + 1 :], skip_special_tokens=True)
            assert isinstance(json.loads(answer)["ok"], bool)
            assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("value", [-2, 2.5, True, "3"])
def test_bad_values_are_refused_naming_the_field(value):
    with pytest.raises(InvalidParamError) as caught:
        SamplingParams(thinking_token_budget=value)
    assert caught.value.param == "thinking_token_budget"


def test_a_model_without_reasoning_tokens_refuses_a_budget(make_checkpoint):
    llm = LLM(make_checkpoint("qwen3_next"), dtype="float32", device="cpu", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="<think>"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, thinking_token_budget=4))
    (out,) = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, thinking_token_budget=-1)
    )
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("budget", [3, 6])
def test_speculative_windows_hold_the_forced_end(tokenized_checkpoint, budget):
    """A bias makes the output one token repeated, which n-gram drafts guess right every time: a
    window verified across the budget would accept drafts past it. With and without drafts, the
    reasoning is the budget's tokens, then `</think>`."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    x = 1000
    outs = []
    for speculative in (None, spec):
        llm = LLM(tokenized_checkpoint, dtype="float32", device="cpu", speculative_config=speculative)
        _, end = think_ids(llm)
        prompt = opened_prompt(llm) + [x] * 4  # drafts from the start: the prompt repeats x too
        outs.append(tokens(llm, prompt, budget, logit_bias={x: 100.0}))
    assert outs[0] == outs[1] == [x] * budget + [end] + [x] * (NEW - budget - 1)


def test_the_state_follows_the_tokens():
    b = ThinkingBudget(2, start=7, end=8, inside=False)
    assert not b.forcing
    b.accept(7)  # opens
    b.accept(1)
    assert not b.forcing
    b.accept(7)  # inside, counted
    assert b.forcing and b.used == 2
    b.accept(8)
    assert b.done and not b.forcing
    late = ThinkingBudget(0, start=7, end=8, inside=False)
    late.accept(1)  # the output did not open reasoning: a later <think> is text
    late.accept(7)
    assert late.done and not late.forcing
