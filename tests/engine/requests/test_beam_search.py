"""Beam search (`LLM.beam_search`, vLLM's algorithm) held to the same search run on
transformers' log-probabilities, fp32 on CPU: the same beams in the same order, the same
cumulative log-probabilities; width 1 is greedy decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deltaserve import LLM, BeamSearchParams, SamplingParams

_IN_SUBPROCESS = """
import json, sys
sys.modules["fla"] = None  # transformers' torch paths, as on a machine without CUDA
sys.path.insert(0, sys.argv[1])
import test_beam_search as t
print(json.dumps(t.hf_beams(*json.load(sys.stdin))))
"""


def hf_beams(
    path: str, prompts: list[list[int]], width: int, steps: int, stop: list[int], penalty: float
) -> list[list[tuple[list[int], float]]]:
    """The search written out on transformers' next-token log-probabilities: every live beam
    grows by its 2 x width likeliest tokens, a stop token ends a beam, the best `width` by
    cumulative log-probability over length ** penalty live on."""
    if torch.cuda.is_available():  # transformers binds FLA's CUDA-only kernels where it can import them
        done = subprocess.run(
            [sys.executable, "-c", _IN_SUBPROCESS, os.path.dirname(os.path.abspath(__file__))],
            input=json.dumps([path, prompts, width, steps, stop, penalty]),
            capture_output=True, text=True, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )  # fmt: skip
        return json.loads(done.stdout.strip().splitlines()[-1])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def score(beam: tuple[list[int], float]) -> float:
        return beam[1] / (len(beam[0]) - (beam[0][-1] in stop)) ** penalty

    results = []
    for prompt in prompts:
        live, ended = [(prompt, 0.0)], []
        for _ in range(steps):
            grown = []
            for tokens, total in live:
                with torch.no_grad():
                    logprobs = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
                values, ids = logprobs.topk(2 * width)
                for t, v in zip(ids.tolist(), values.tolist()):
                    (ended if t in stop else grown).append((tokens + [t], total + v))
            live = sorted(grown, key=score, reverse=True)[:width]
            if not live:
                break
        best = sorted(ended + live, key=score, reverse=True)[:width]
        results.append([(tokens[len(prompt) :], total) for tokens, total in best])
    return results


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def path(make_checkpoint) -> str:
    return make_checkpoint("qwen3_5")


@pytest.mark.parametrize(("width", "penalty"), [(3, 1.0), (4, 0.0)])
def test_beams_equal_the_search_on_transformers(path, width: int, penalty: float, pools_held) -> None:
    prompts = prompts_of([6, 40], seed=1)
    llm = LLM(path, dtype="float32", device="cpu", chunked_prefill_size=32, max_model_len=256)
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    ref = hf_beams(path, prompts, width, 5, list(llm.engine.eos_token_ids), penalty)
    for out, want in zip(outs, ref):
        assert [b.output_ids for b in out.sequences] == [tokens for tokens, _ in want]
        assert [b.cum_logprob for b in out.sequences] == pytest.approx([total for _, total in want], abs=1e-4)
        assert all(len(b.logprobs) == len(b.output_ids) for b in out.sequences)
    assert len({tuple(b.output_ids) for b in outs[0].sequences}) == width  # distinct beams
    assert not pools_held(llm)


def test_beams_that_reach_a_stop_token_end_there(path, monkeypatch) -> None:
    """With the likeliest second tokens as stop tokens, some beams end early, ranked by their
    length less the stop token, as on transformers."""
    prompts = prompts_of([9], seed=3)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256)
    first = llm.generate(
        [{"prompt_token_ids": prompts[0]}],
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )
    stop = [first[0].outputs[0].token_ids[1], *llm.engine.eos_token_ids]
    monkeypatch.setattr(llm.engine, "eos_token_ids", stop)
    out = llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=3, max_tokens=5))[0]
    want = hf_beams(path, prompts, 3, 5, stop, 1.0)[0]
    assert [b.output_ids for b in out.sequences] == [tokens for tokens, _ in want]
    reasons = [b.finish_reason for b in out.sequences]
    assert "stop" in reasons and all(
        (r == "stop") == (b.output_ids[-1] in stop) for r, b in zip(reasons, out.sequences)
    )


def test_width_one_is_greedy_decoding(path) -> None:
    prompts = prompts_of([7, 30], seed=2)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256)
    beams = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True),
    )
    greedy = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    assert [b.sequences[0].output_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]


def test_concurrency_limit_searches_that_many_prompts_at_once(path, monkeypatch) -> None:
    """vLLM's concurrency_limit=N: the prompts are searched N at a time, each step's requests
    the live beams of N prompts at most (they were every prompt's), and the beams are those of
    the search of all at once, in the prompts' order."""
    prompts = [{"prompt_token_ids": p} for p in prompts_of([5, 9, 3, 12, 7], seed=5)]
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    whole = llm.beam_search(prompts, params)
    steps: list[int] = []
    generate = llm.generate

    def counting(step_prompts: list, *args: object, **kwargs: object) -> list:
        steps.append(len(step_prompts))  # one search step's requests
        return generate(step_prompts, *args, **kwargs)

    monkeypatch.setattr(llm, "generate", counting)
    for limit in (1, 2, 5, 8):
        steps.clear()
        before = llm.engine.stats()["generation_tokens_total"]
        limited = llm.beam_search(prompts, params, use_tqdm=True, concurrency_limit=limit)
        returned = sum(len(b.output_ids) for o in limited for b in o.sequences)
        assert llm.engine.stats()["generation_tokens_total"] - before == returned  # counted once
        assert max(steps) <= min(limit, 5) * params.beam_width and steps[0] == min(limit, 5)
        assert [[b.output_ids for b in o.sequences] for o in limited] == [
            [b.output_ids for b in o.sequences] for o in whole
        ], limit
        for got, want in zip(limited, whole):
            assert [b.cum_logprob for b in got.sequences] == pytest.approx(
                [b.cum_logprob for b in want.sequences], abs=1e-5
            )
            assert [b.text for b in got.sequences] == [b.text for b in want.sequences]
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="^concurrency_limit must be"):
            llm.beam_search(prompts, params, concurrency_limit=bad)


def test_use_tqdm_draws_a_bar_over_the_token_steps(path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's use_tqdm: a bar over the steps, bounded by max_tokens; none with use_tqdm False,
    and none, with a warning, where concurrency_limit is given."""
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256)
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 3]}]
    made: list[dict] = []
    steps: list[int] = []

    def bar(**kwargs: object) -> object:
        made.append(kwargs)
        return type("Bar", (), {"update": lambda self, n: steps.append(n), "close": lambda self: None})()

    llm.beam_search(prompts, params, use_tqdm=bar)
    assert [m["total"] for m in made] == [3] and steps == [1, 1, 1]
    made.clear()
    llm.beam_search(prompts, params, use_tqdm=False)
    assert made == []
    with caplog.at_level("WARNING"):
        llm.beam_search(prompts, params, use_tqdm=bar, concurrency_limit=1)
    assert made == [] and "concurrency_limit" in caplog.text


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)


def test_a_search_counts_once_in_the_engine_stats(path) -> None:
    """The engine's token counters count each prompt's search once, as the server's /metrics do:
    its prompt's tokens (prompt, prefill, the cache's hits: its first step's) and the tokens of
    the beams it returns; they counted every step's requests (3- and 5-token prompts, width 2,
    4 tokens: 80 prompt tokens and 14 generated for 16 returned)."""
    prompts = prompts_of([3, 5], seed=4)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256)
    before = llm.engine.stats()
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True),
    )
    after = llm.engine.stats()

    def grew(name: str) -> int:
        return after[name] - before[name]

    assert grew("prompt_tokens_total") == grew("prefill_tokens_total") == 3 + 5
    assert grew("prefix_cache_query_tokens") == 3 + 5 and grew("cached_tokens_total") == 0
    assert grew("generation_tokens_total") == sum(len(b.output_ids) for o in outs for b in o.sequences) == 16


def test_a_prompts_cache_salt_holds_for_its_search(path) -> None:
    """vLLM's prompt dict `cache_salt`: every step of that prompt's search caches under it, so a
    resend of the prompt hits under the salt and not without it; the other prompt's is unsalted."""
    salted, plain = prompts_of([40, 40], seed=5)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256)
    llm.beam_search(
        [{"prompt_token_ids": salted, "cache_salt": "x"}, {"prompt_token_ids": plain}],
        BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True),
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = [
        {"prompt_token_ids": salted},
        {"prompt_token_ids": salted, "cache_salt": "x"},
        {"prompt_token_ids": plain},
    ]
    cached = [llm.generate([p], greedy, use_tqdm=False)[0].num_cached_tokens for p in prompts]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0


def test_a_beams_text_is_its_prompt_and_tokens_decoded_as_vllms(tokenized_checkpoint, monkeypatch) -> None:
    """vLLM's LLM.beam_search sets each beam's text to its whole token list decoded: the prompt's
    text, then the output's, a stop token that ended it included."""
    llm = LLM(tokenized_checkpoint, dtype="float32", device="cpu", max_model_len=256)
    prompt = "The capital of France is"
    first = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    stop = first[0].outputs[0].token_ids[1]  # the greedy beam's second token ends it
    monkeypatch.setattr(llm.engine, "eos_token_ids", [stop, *llm.engine.eos_token_ids])
    (out,) = llm.beam_search([{"prompt": prompt}], BeamSearchParams(beam_width=2, max_tokens=4))
    ended = [b for b in out.sequences if b.finish_reason == "stop"]
    assert ended and all(b.output_ids[-1] == stop for b in ended)
    tok = llm.get_tokenizer()
    for beam in out.sequences:
        assert beam.text.startswith(prompt)
        assert beam.text == tok.decode(beam.tokens)
    assert all(b.text.endswith(tok.decode([stop])) for b in ended)
