"""Kimi-Linear's tokenizer read natively (`models/checkpoints/tiktoken_tokenizer.py`) against tiktoken itself
(what Kimi's remote code wraps), on a toy `tiktoken.model` built here: the same ids for mixed
Latin / CJK / digit / whitespace text and special-token text, the same decoded text, and a tiny
Kimi-Linear checkpoint with it serves text prompts and a chat template end to end."""

from __future__ import annotations

import random

import pytest

tiktoken = pytest.importorskip("tiktoken")

from deltaserve.models.checkpoints.tiktoken_tokenizer import (  # noqa: E402
    KIMI_PATTERN,
    NUM_SPECIAL,
    load_tiktoken_tokenizer,
)


def oracle(ranks: dict[bytes, int], specials: dict[int, str]):
    base = len(ranks)
    special = {specials.get(i, f"<|reserved_token_{base + i}|>"): base + i for i in range(NUM_SPECIAL)}
    return tiktoken.Encoding(name="toy", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def test_ids_and_text_match_tiktoken(kimi_tokenizer_folder):
    path, ranks, specials, corpus = kimi_tokenizer_folder
    tok, ref = load_tiktoken_tokenizer(path), oracle(ranks, specials)
    rng = random.Random(0)
    pieces = corpus.split(" ") + [
        "<|im_end|>",
        "[EOS]",
        "\n",
        "  ",
        "１２３",
        "Ünïcödé",
        "'S",
        "DON'T",
        "x" * 40,
    ]
    texts = [corpus, "<|im_user|>user<|im_middle|>你好<|im_end|>"]
    texts += [" ".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref.encode(text, allowed_special="all"), text
        assert tok.decode(ids) == ref.decode(ids) == text
    base = len(ranks)
    assert tok.convert_tokens_to_ids("<|im_end|>") == base + 2
    assert tok.convert_ids_to_tokens(base + 5) == f"<|reserved_token_{base + 5}|>"
    assert len(tok) == base + NUM_SPECIAL
    assert tok.eos_token == "[EOS]" and tok.eos_token_id == base + 1
    assert tok.decode([base + 2, *ref.encode("ok")], skip_special_tokens=True) == "ok"
    # tool-call markers stay in the text the server parses; other special tokens do not
    assert tok.convert_tokens_to_ids("<|tool_call_begin|>") == base + 13
    call = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    ids = ref.encode(call + "<|tool_calls_section_end|>[EOS]", allowed_special="all")
    assert tok.decode(ids, skip_special_tokens=True) == call + "<|tool_calls_section_end|>"


@pytest.fixture(scope="module")
def kimi_llm(kimi_tokenizer_folder, tmp_path_factory, kimi_builder, kimi_config):
    """A tiny random Kimi-Linear checkpoint with the toy tokenizer, loaded."""
    import shutil

    from deltaserve import LLM

    path, ranks, _, _ = kimi_tokenizer_folder
    ckpt = tmp_path_factory.mktemp("kimi")
    kimi_builder(str(ckpt), {**kimi_config, "vocab_size": len(ranks) + NUM_SPECIAL})
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(f"{path}/{name}", ckpt / name)
    return LLM(str(ckpt), dtype="float32", device="cpu")


@pytest.mark.slow
def test_a_kimi_checkpoint_serves_text_with_it(kimi_llm, kimi_tokenizer_folder):
    """The engine loads the tokenizer from a Kimi checkpoint folder (no remote code run), renders
    its chat template and returns text; the prompt's ids are tiktoken's."""
    from deltaserve import SamplingParams

    _, ranks, specials, _ = kimi_tokenizer_folder
    llm = kimi_llm
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "中国 fox?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.prompt_token_ids == oracle(ranks, specials).encode(prompt, allowed_special="all")
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_forced_kimi_tool_call(kimi_llm):
    """tool_choice's grammar in Kimi's form (up to three calls in one section, numbered): the
    random model's reply parses, with the server's Kimi parser, as calls whose arguments satisfy
    the schema."""
    import json

    pytest.importorskip("xgrammar")
    from deltaserve import SamplingParams
    from deltaserve.engine.requests.sampling_params import StructuredOutputs
    from deltaserve.server.text.tool_calls import KIMI, extract_tool_calls

    params = {
        "type": "object",
        "properties": {"unit": {"enum": ["C", "F"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["unit", "days"],
        "additionalProperties": False,
    }
    spec = StructuredOutputs(
        tool_calls=[{"name": "get_weather", "parameters": params}], tool_call_form="kimi", max_tool_calls=3
    )
    outs = kimi_llm.generate(
        ["Weather?"] * 4,
        [SamplingParams(temperature=1.0, seed=s, max_tokens=400, structured_outputs=spec) for s in range(4)],
    )
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        content, calls = extract_tool_calls(c.text, {"get_weather": params}, final=True, fmt=KIMI)
        assert content == "" and 1 <= len(calls) <= 3, c.text
        for i, call in enumerate(calls):
            assert call.name == "get_weather" and f"functions.get_weather:{i}" in c.text  # numbered in turn
            args = json.loads(call.arguments)
            assert args["unit"] in ("C", "F") and 1 <= args["days"] <= 7


def test_tools_render_with_sorted_keys_as_kimis_code_does(kimi_tokenizer_folder):
    """Kimi's remote code sorts every key of the tools before its template renders them; the
    native tokenizer does the same (other tokenizers keep the client's order)."""
    import json

    from transformers import PreTrainedTokenizerFast

    from deltaserve.server.protocol import ChatMessage, ToolDefinition
    from deltaserve.server.text.chat_template import render_chat

    tool = ToolDefinition.model_validate(
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "required": ["z"], "properties": {"z": {"type": "string"}}},
            },
        }
    )
    template = "{{ tools | tojson }}"
    messages = [ChatMessage(role="user", content="hi")]
    kimi = load_tiktoken_tokenizer(kimi_tokenizer_folder[0])
    rendered = json.loads(render_chat(kimi, messages, template=template, tools=[tool]))
    assert list(rendered[0]) == ["function", "type"]
    assert list(rendered[0]["function"]["parameters"]) == ["properties", "required", "type"]
    plain = PreTrainedTokenizerFast(tokenizer_object=kimi.backend_tokenizer)
    kept = json.loads(render_chat(plain, messages, template=template, tools=[tool]))
    assert list(kept[0]["function"]["parameters"]) == ["type", "required", "properties"]
