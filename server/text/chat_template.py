"""Render OpenAI chat messages into a prompt with the model's chat template (or a `--chat-template`
file), passing tools and `chat_template_kwargs` such as `enable_thinking` through to it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltaserve.engine.requests.chat_prompt import (
    ChatTemplateError,
    check_parts,
    render_prompt,
    template_message,
    unrepeated_tail,
)
from deltaserve.engine.requests.chat_prompt import image_urls as chat_image_urls
from deltaserve.engine.requests.chat_prompt import shared_head_tokens as chat_shared_head_tokens

from ..errors import bad_request
from ..protocol import ChatMessage, ToolDefinition


def template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """The tools as the template reads them: without `strict`, which is the server's to enforce,
    so that a strict tool's prompt is the same as a plain one's."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in tools]


def load_chat_template(source: str | None) -> str | None:
    """`--chat-template`: a file's template, or the template given itself; None keeps the
    tokenizer's own."""
    if source is None:
        return None
    return Path(source).read_text(encoding="utf-8") if Path(source).is_file() else source


def message_to_dict(message: ChatMessage, index: int = 0, content_format: str = "auto") -> dict[str, Any]:
    """The message as its chat template reads it (`template_message`, an image part as the
    template's `{"type": "image"}`); a content part the server cannot read (audio, a file) is a
    400 naming it, not dropped (`check_parts`, as the offline LLM.chat refuses it)."""
    message_dict = message.model_dump(exclude_none=True)
    try:
        check_parts(message_dict, index)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), exc.param) from exc
    try:
        rendered = template_message(message_dict, content_format)
    except ChatTemplateError as exc:  # a malformed part of this message: named where it is
        raise bad_request(f"messages[{index}].{exc}", f"messages.{index}.{exc.param}") from exc
    for j, call in enumerate(message.tool_calls or []):
        # OpenAI's and vLLM's request schemas require both (the offline LLM.chat does not)
        for key in ("id", "type"):
            if call.get(key) is None:
                raise bad_request(
                    f"messages[{index}].tool_calls[{j}]: a tool call needs its {key}",
                    f"messages.{index}.tool_calls.{j}.{key}",
                )
    return rendered


def image_urls(messages: list[ChatMessage]) -> list[str]:
    """The messages' image URLs, in the order the template writes their placeholders."""
    return chat_image_urls([m.model_dump(exclude_none=True) for m in messages])


def first_image_part(messages: list[ChatMessage]) -> str:
    """Where the messages' first image part is, as a 400's `param` names it."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.image_url is not None or part.type == "image_url":
                return f"messages.{i}.content.{j}.type"
    return "messages"


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    *,
    template: str | None = None,
    tools: list[ToolDefinition] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text (`render_prompt`); what cannot render (no template, a role the template
    refuses) is a 400."""
    try:
        return render_prompt(
            tokenizer,
            [message_to_dict(m, i, content_format) for i, m in enumerate(messages)],
            template=template,
            tools=template_tools(tools),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
            content_format=content_format,
            documents=documents,
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), exc.param) from exc


def next_turn_start(
    tokenizer: Any,
    messages: list[ChatMessage],
    prompt: str,
    *,
    template: str | None = None,
    tools: list[ToolDefinition] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> int:
    """Where the conversation's next request stops repeating `prompt` (`unrepeated_tail`)."""
    return unrepeated_tail(
        tokenizer,
        [message_to_dict(m, i, content_format) for i, m in enumerate(messages)],
        prompt,
        template=template,
        tools=template_tools(tools),
        template_kwargs=template_kwargs,
        content_format=content_format,
    )


def shared_head_tokens(
    tokenizer: Any,
    messages: list[ChatMessage],
    prompt_ids: list[int],
    encode: Callable[[str], list[int]],
    *,
    template: str | None = None,
    tools: list[ToolDefinition] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> int:
    """How many of `prompt_ids`' first tokens every conversation with these messages' system prompt
    and tools begins with (`chat_prompt.shared_head_tokens`)."""
    return chat_shared_head_tokens(
        tokenizer,
        [message_to_dict(m, i, content_format) for i, m in enumerate(messages[:1])],
        prompt_ids,
        encode,
        template=template,
        tools=template_tools(tools),
        template_kwargs=template_kwargs,
        content_format=content_format,
    )
