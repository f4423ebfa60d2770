"""Detokenization and stop strings, with the real Qwen3 tokenizer."""

from __future__ import annotations

import itertools

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(tokenized_checkpoint):
    return LLM(tokenized_checkpoint, dtype="float32", device="cpu", chunked_prefill_size=64)


def test_incremental_detokenization_never_splits_characters(llm):
    tok = llm.tokenizer
    text = "naïve café — 東京 🚀 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.append(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_text_prompt_and_stop_string_trimmed(llm):
    params = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = llm.generate("Hello, my name is", SamplingParams(**params))[0].outputs[0]
    assert free.text and free.finish_reason == "length"
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    cut = free.text.index(stop)
    out = llm.generate("Hello, my name is", SamplingParams(stop=[stop], **params))[0].outputs[0]
    assert out.text == free.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        "Hello, my name is", SamplingParams(stop=[stop], include_stop_str_in_output=True, **params)
    )
    assert kept[0].outputs[0].text == free.text[: cut + len(stop)]


@pytest.mark.parametrize("fast", [True, False])
def test_streamed_text_equals_one_decode(llm, fast):
    """Both detokenizer paths (DecodeStream, window re-decode) agree with a whole decode."""
    tok = llm.tokenizer
    ids = tok.encode("Ünïcödé ✓ 東京 🚀🚀 <|im_end|> tail\n\tend")
    ids += [ids[3], 151643, ids[5]]  # a special token mid-stream
    detok = IncrementalDetokenizer(tok)
    if not fast:
        detok._stream = None
    for i in ids:
        detok.append(i)
    detok.flush()
    assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_delta_outputs_add_up_to_the_cumulative_ones(llm):
    """`output_kind="delta"` (what streams use): each output holds what its step added, an output
    comes only from steps that add tokens, and joined they equal a cumulative request's outputs,
    text held back for a stop string included; `num_tokens` counts every token so far."""
    engine = llm.engine
    prompt = llm.tokenizer.encode("Hello, my name is")
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    free = llm.generate("Hello, my name is", SamplingParams(**base))[0].outputs[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    for extra in ({}, {"stop": [stop]}, {"stop": [stop], "include_stop_str_in_output": True}):
        runs: dict[str, list] = {"cumulative": [], "delta": []}
        for kind in runs:
            engine.add_request(kind, prompt, SamplingParams(output_kind=kind, **base, **extra))
        while engine.has_unfinished_requests():
            for out in engine.step():
                runs[out.request_id].append(out.outputs[0])
        cumulative, deltas = runs["cumulative"], runs["delta"]
        last = cumulative[-1]
        assert "".join(d.text for d in deltas) == last.text
        assert [t for d in deltas for t in d.token_ids] == last.token_ids
        joined = [lp for d in deltas for lp in d.logprobs]
        # (two rows of one batch: the values may differ in the last bits)
        assert [lp.token_id for lp in joined] == [lp.token_id for lp in last.logprobs]
        assert [lp.logprob for lp in joined] == pytest.approx([lp.logprob for lp in last.logprobs], abs=1e-4)
        assert all(d.token_ids for d in deltas)  # no empty outputs while running
        assert [d.num_tokens for d in deltas] == list(itertools.accumulate(len(d.token_ids) for d in deltas))
        assert deltas[-1].finish_reason == last.finish_reason and deltas[-1].num_tokens == len(last.token_ids)
        # Step by step, the text sent so far is the cumulative output's text of the same step.
        sent = ""
        for d, c in zip(deltas, cumulative):
            sent += d.text
            assert sent == c.text


def test_deferred_detokenizer_gives_the_incremental_text(llm):
    """A final-only request without stop strings decodes its text once, at the end: the same text
    as token-by-token decoding, multi-byte characters and special tokens included."""
    tok = llm.tokenizer
    ids = tok.encode("Ünïcödé ✓ 東京 🚀🚀 <|im_end|> tail\n\tend")
    ids += [ids[3], 151643, ids[5]]
    incremental, deferred = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok, deferred=True)
    for i in ids:
        incremental.append(i)
        assert deferred.append(i) == "" and deferred.length == 0  # nothing decoded while running
    incremental.flush()
    assert deferred.flush() == deferred.text == incremental.text


def test_final_only_text_equals_the_streamed_text(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode("Hello, my name is")
    texts = {}
    for kind in ("cumulative", "final_only"):
        for rid, n in ((f"{kind}-done", 12), (f"{kind}-aborted", 40)):
            engine.add_request(
                rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=kind)
            )
    for _ in range(6):  # the long ones are aborted while running
        engine.step()
    engine.abort_request("cumulative-aborted")
    engine.abort_request("final_only-aborted")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = (out.outputs[0].text, out.outputs[0].token_ids)
    for out in engine.step():
        texts[out.request_id] = (out.outputs[0].text, out.outputs[0].token_ids)
    assert texts["final_only-done"] == texts["cumulative-done"] and texts["final_only-done"][0]
    text, ids = texts["final_only-aborted"]
    assert ids and text == llm.tokenizer.decode(ids, skip_special_tokens=True)
