"""The offline API's `LLM.chat` (vLLM's): conversations rendered with the checkpoint's chat template
(the real Qwen3 tokenizer's), then generated as their token ids would be, and held to transformers."""

from __future__ import annotations

import re

import pytest

from deltaserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CHAT = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]},
]


@pytest.fixture(scope="module")
def llm(tokenized_checkpoint: str) -> LLM:
    return LLM(tokenized_checkpoint, dtype="float32", device="cpu")


def rendered_ids(llm: LLM, messages: list[dict], **kwargs) -> list[int]:
    """What transformers' own template call gives for the messages as OpenAI's clients send them
    (developer read as system, text parts joined by newlines)."""
    plain = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name\na colour."},
    ][: len(messages)]
    text = llm.get_tokenizer().apply_chat_template(plain, tokenize=False, **kwargs)
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_chat_is_generate_on_the_rendered_prompt(llm: LLM, tokenized_checkpoint: str, hf_reference) -> None:
    (out,) = llm.chat(CHAT, GREEDY)
    ids = rendered_ids(llm, CHAT, add_generation_prompt=True)
    assert out.prompt_token_ids == ids and out.prompt.endswith("<|im_start|>assistant\n")
    assert list(out.outputs[0].token_ids) == hf_reference(tokenized_checkpoint, [ids], 6)[0]


def test_several_conversations_come_back_in_order(llm: LLM) -> None:
    one, two = CHAT[:1] + [{"role": "user", "content": "Hi"}], CHAT
    outs = llm.chat([one, two], GREEDY)
    alone = [llm.chat(c, GREEDY)[0] for c in (one, two)]
    assert [o.prompt for o in outs] == [a.prompt for a in alone]
    assert [o.outputs[0].token_ids for o in outs] == [a.outputs[0].token_ids for a in alone]


def test_continuing_the_last_message_leaves_its_turn_open(llm: LLM) -> None:
    opened = CHAT + [{"role": "assistant", "content": "The colour is"}]
    (out,) = llm.chat(opened, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("The colour is")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(opened, GREEDY, continue_final_message=True)  # a generation prompt would close it


def test_template_keywords_and_a_template_of_ones_own(llm: LLM) -> None:
    (own,) = llm.chat(
        CHAT, GREEDY, chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    )
    assert own.prompt == "[system] Be brief.\n[user] Name\na colour.\n"
    with pytest.raises(ValueError, match="could not render"):
        llm.chat(CHAT, GREEDY, chat_template="{{ raise_exception('no') }}")


def test_reset_prefix_cache_drops_the_cached_prompt(llm: LLM) -> None:
    first = llm.chat(CHAT, GREEDY)[0]
    assert llm.chat(CHAT, GREEDY)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    again = llm.chat(CHAT, GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_next_turn_starts_where_the_history_leaves_the_generation_prompt(llm: LLM) -> None:
    """enable_thinking false: the generation prompt ends in an empty reasoning block (four tokens)
    that the next turn's history does not render. With a page boundary inside it, LLM.chat keeps
    the prompt end's state at the page boundary before it, as the server does: turn 2 starts there."""
    import uuid

    off = {"enable_thinking": False}
    page = llm.engine.config.page_size
    tok = llm.get_tokenizer()

    def count(messages: list[dict]) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **off)
        return tok.encode(text, add_special_tokens=False)

    words = f"{uuid.uuid4().hex} Answer in one line."
    while len(count([{"role": "user", "content": words}])) % page != 2:
        words += " y"
    messages = [{"role": "user", "content": words}]
    (first,) = llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs=off)
    messages += [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "Then?"},
    ]
    kept = len(first.prompt_token_ids) - 4
    assert count(messages)[:kept] == first.prompt_token_ids[:kept]
    (second,) = llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs=off)
    assert second.num_cached_tokens == kept // page * page > 0


def test_a_second_conversation_starts_after_the_shared_system_prompt(llm: LLM) -> None:
    """The first conversation's prefill keeps the state at the last page boundary of what every
    conversation with its system prompt begins with, as the server does: the second starts there."""
    import uuid

    system = {"role": "system", "content": f"{uuid.uuid4().hex} " + "Be brief and kind. " * 30}
    a, b = (
        llm.chat([system, {"role": "user", "content": q}], GREEDY, use_tqdm=False)[0] for q in ("Hi", "Why?")
    )
    common = next(i for i, (x, y) in enumerate(zip(a.prompt_token_ids, b.prompt_token_ids)) if x != y)
    page = llm.engine.config.page_size
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == common // page * page > 0


def test_vllms_chat_template_content_format(llm: LLM) -> None:
    """'auto' and 'string' (what these templates read) are taken; 'openai' is refused, naming why."""
    want = llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for fmt in ("auto", "string"):
        (out,) = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template_content_format=fmt)
        assert out.outputs[0].token_ids == want
    with pytest.raises(ValueError, match="chat_template_content_format 'openai'"):
        llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template_content_format="openai")
    assert llm.llm_engine is llm.engine  # vLLM's name for it


def test_images_for_a_model_that_reads_text_only_are_refused_by_name(llm: LLM) -> None:
    """An image part for a text-only model says that, as the server's chat endpoint does (it was
    the text template's own failure on the part, "'list object' has no attribute ..."), and the
    next chat runs."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    pictured = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
    with pytest.raises(ValueError, match="the prompt has images, but the model .* reads text only"):
        llm.chat([CHAT, pictured], GREEDY)
    assert not llm.engine.requests
    assert len(llm.chat(CHAT, GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize(
    "part,needle",
    [
        (
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            "'input_audio': not supported",
        ),
        ({"type": "file", "file": {"file_id": "file-1"}}, "'file': not supported"),
        ({"type": "input_image", "file_id": "file-1"}, "'input_image': give its image_url"),
        ({"type": "text"}, "a text part needs its text"),
    ],
)
def test_content_parts_chat_cannot_read_are_refused_not_dropped(llm: LLM, part: dict, needle: str) -> None:
    """Audio, a file, an image given by file id or a text part without its text is a ValueError
    naming the part, as the server's 400 does (they were left out of the prompt, answering another
    question); nothing is queued."""
    content = [{"type": "text", "text": "What is in this?"}, part]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    with pytest.raises(ValueError, match=rf"messages\[1\]\.content\[1\]: .*{re.escape(needle)}"):
        llm.chat([CHAT, conversation], GREEDY)
    assert not llm.engine.requests


def test_the_responses_apis_parts_are_read_as_the_servers_chat_reads_them(llm: LLM) -> None:
    """vLLM's chat (offline as served) takes `input_text` / `output_text` parts as text parts and an
    `input_image` (its `image_url` a URL string) as an image part: the same prompt, and the same
    refusal of an image by a text-only model, as the chat parts give."""
    responses_style = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Name"}, {"type": "text", "text": "a colour."}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "Red.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Another."}]},
    ]
    chat_style = [
        {**m, "content": [{"type": "text", "text": p["text"]} for p in m["content"]]} for m in responses_style
    ]
    mine, want = (llm.chat(c, GREEDY, use_tqdm=False)[0] for c in (responses_style, chat_style))
    assert "Red." in want.prompt and "Another." in want.prompt
    assert mine.prompt == want.prompt and mine.prompt_token_ids == want.prompt_token_ids
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    pictured = [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"}, image]}]
    with pytest.raises(ValueError, match="the prompt has images, but the model .* reads text only"):
        llm.chat(pictured, GREEDY)
