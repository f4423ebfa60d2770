"""Detokenization and stop strings, with the real Qwen3 tokenizer."""

from __future__ import annotations

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
