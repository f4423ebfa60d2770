"""Detokenization and stop strings, with the real Qwen3 tokenizer."""

from __future__ import annotations

import itertools
import random

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer


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


@pytest.mark.slow
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


def test_stop_token_text_is_left_out_unless_asked_for(llm):
    """A request that a stop token ends keeps the token's id but not its text, as vLLM's does;
    with include_stop_str_in_output the text has it too."""
    tok = llm.tokenizer
    params = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = llm.generate("Hello, my name is", SamplingParams(**params))[0].outputs[0]
    ids = list(free.token_ids)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tok.decode([ids[i]]).strip())
    for include in (False, True):
        out = llm.generate(
            "Hello, my name is",
            SamplingParams(stop_token_ids=[ids[k]], include_stop_str_in_output=include, **params),
        )[0].outputs[0]
        assert list(out.token_ids) == ids[: k + 1]
        assert out.finish_reason == "stop" and out.stop_reason == ids[k]
        assert out.text == tok.decode(ids[: k + 1] if include else ids[:k], skip_special_tokens=True)


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


def byte_token_ids(tok) -> dict[int, int]:
    """The token of each single byte in a byte-level BPE vocabulary (GPT-2's printable alphabet:
    bytes outside the printable ranges are shifted past 255)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shift)
            shift += 1
    return {b: tok.convert_tokens_to_ids(c) for b, c in chars.items()}


@pytest.mark.parametrize("fast", [True, False])
def test_byte_runs_stay_exact_and_the_held_window_bounded(llm, fast):
    """Runs of byte tokens that never form UTF-8 (random weights emit them) held the whole run
    back, decoded again with every token: the held-back window is now bounded, and the text
    still equals one decode of everything, characters split across tokens included."""
    tok = llm.tokenizer
    byte_id = byte_token_ids(tok)
    rng = random.Random(0)
    words = [" hello world", " naïve café", " 東京 🚀", "\n\tend", "🚀🚀"]
    for _ in range(25):
        ids: list[int] = []
        for _ in range(rng.randint(3, 12)):
            kind = rng.random()
            if kind < 0.2:  # bytes 0x80-0xff: continuation and lead bytes out of order
                ids += [byte_id[rng.randrange(0x80, 0x100)] for _ in range(rng.randint(1, 60))]
            elif kind < 0.4:  # continuation bytes only: no character ever completes
                ids += [byte_id[rng.randrange(0x80, 0xC0)] for _ in range(rng.randint(20, 80))]
            elif kind < 0.6:  # valid characters, one byte token each
                ids += [byte_id[b] for b in rng.choice(words).encode()]
            elif kind < 0.95:
                ids += tok.encode(rng.choice(words))
            else:
                ids.append(151643)  # a special token
        detok = IncrementalDetokenizer(tok)
        if not fast:
            detok._stream = None
        held = 0
        for i in ids:
            detok.append(i)
            held = max(held, len(detok.ids) - detok._read_offset)
        detok.flush()
        assert detok.text == tok.decode(ids, skip_special_tokens=True)
        assert held <= 24  # tokens decoded again with each new one


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_stream_interval_sends_the_first_token_then_groups(tokenized_checkpoint, llm):
    """`stream_interval=3`: a delta request's first output carries its first token, each later
    one three tokens, the last what is left; joined they are the cumulative request's tokens and
    text (with a stop string too), and non-streamed outputs are unchanged."""
    grouped = LLM(
        tokenized_checkpoint, dtype="float32", device="cpu", chunked_prefill_size=64, stream_interval=3
    )
    prompt = llm.tokenizer.encode("Hello, my name is")
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = llm.generate("Hello, my name is", SamplingParams(**base))[0].outputs[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    for extra in ({}, {"stop": [stop]}):
        whole = llm.generate("Hello, my name is", SamplingParams(**base, **extra))[0].outputs[0]
        assert grouped.generate("Hello, my name is", SamplingParams(**base, **extra))[0].outputs[0] == whole
        grouped.engine.add_request("d", prompt, SamplingParams(output_kind="delta", **base, **extra))
        deltas = []
        while grouped.engine.has_unfinished_requests():
            deltas += [out.outputs[0] for out in grouped.engine.step()]
        sizes = [len(d.token_ids) for d in deltas]
        assert sizes[0] == 1 and set(sizes[1:-1]) <= {3} and 1 <= sizes[-1] <= 3, sizes
        assert [t for d in deltas for t in d.token_ids] == whole.token_ids
        assert "".join(d.text for d in deltas) == whole.text
        assert deltas[-1].finish_reason == whole.finish_reason


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


@pytest.mark.slow
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


def test_vllms_bad_words_and_prompt_truncation(llm):
    """SamplingParams takes vLLM's bad_words (text: its tokens never generated),
    truncate_prompt_tokens (the prompt's last k tokens) and spaces_between_special_tokens, as
    vLLM scripts pass them."""
    tok = llm.tokenizer
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = llm.generate("Hello, my name is", SamplingParams(**greedy))[0].outputs[0]
    # a token that is a word of its own: the text it decodes to tokenizes back to it alone
    word_id = next(t for t in free.token_ids if tok.encode(tok.decode([t]).lstrip()) == [t])
    word = tok.decode([word_id])
    banned = llm.generate("Hello, my name is", SamplingParams(bad_words=[word], **greedy))[0].outputs[0]
    assert word_id not in banned.token_ids and len(banned.token_ids) == 12
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])

    ids = tok.encode("one two three four five six")
    (cut,) = llm.generate("one two three four five six", SamplingParams(truncate_prompt_tokens=3, **greedy))
    (alone,) = llm.generate({"prompt_token_ids": ids[-3:]}, SamplingParams(**greedy))
    assert cut.prompt_token_ids == ids[-3:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = SamplingParams(truncate_prompt_tokens=-1, spaces_between_special_tokens=False, **greedy)
    assert llm.generate("one two three four five six", whole)[0].prompt_token_ids == ids
    for k in (0, llm.engine.max_model_len + 1):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.generate("one two", SamplingParams(truncate_prompt_tokens=k, **greedy))


def test_vllms_prompt_and_output_types_import_from_deltaserve(llm):
    """A vLLM script's `from vllm import TextPrompt, TokensPrompt, RequestOutput, CompletionOutput`
    runs with deltaserve's package name: the prompts generate as their dicts do, and the outputs
    are of the types imported."""
    from deltaserve import CompletionOutput, RequestOutput, TextPrompt, TokensPrompt

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = llm.tokenizer.encode("Hello, my name is")
    text, tokens = llm.generate(
        [TextPrompt(prompt="Hello, my name is"), TokensPrompt(prompt_token_ids=ids)], greedy
    )
    assert isinstance(text, RequestOutput) and isinstance(text.outputs[0], CompletionOutput)
    assert (text.prompt, tokens.prompt) == ("Hello, my name is", None)
    assert text.prompt_token_ids == tokens.prompt_token_ids == ids
    assert text.outputs[0].token_ids == tokens.outputs[0].token_ids
    assert text.finished and text.outputs[0].finished()  # vLLM's: an attribute, then a method
