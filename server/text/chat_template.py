"""Render OpenAI chat messages into a prompt with the model's chat template (or a `--chat-template`
file), passing tools and `chat_template_kwargs` such as `enable_thinking` through to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import bad_request
from ..protocol import ChatMessage, ToolDefinition


def load_chat_template(path: str | None) -> str | None:
    """Read a `--chat-template` file; None keeps the tokenizer's own template."""
    return Path(path).read_text(encoding="utf-8") if path else None


# the content parts a text model reads; an image, audio or file part is refused, not dropped
TEXT_PARTS = ("text", "refusal")


def message_to_dict(message: ChatMessage, index: int = 0) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type not in TEXT_PARTS:
                raise bad_request(
                    f"messages[{index}].content[{j}]: content parts of type {part.type!r} are not supported: "
                    "this server reads text only",
                    f"messages.{index}.content.{j}.type",
                )
            value = part.text if part.type == "text" else part.refusal
            if value is not None:
                texts.append(value)
        content = "\n".join(texts)
    # Templates test content with `in` and `startswith`, which fail on None.
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": content or "",
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [_tool_call_for_template(call) for call in message.tool_calls]
    return out


def _tool_call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    # OpenAI sends arguments as a JSON string; Qwen3.5's template iterates them as a mapping, and
    # Qwen3's accepts both, so hand templates the parsed object.
    call = dict(call)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    call["function"] = function
    return call


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    *,
    template: str | None = None,
    tools: list[ToolDefinition] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text; template errors (e.g. a role the template refuses) are 400s.
    `continue_final_message`: the text ends with the last message's content, its turn left open
    (no end-of-turn marker), so the model goes on writing that message (vLLM's field)."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "this model has no chat template; start the server with --chat-template", "messages"
        )
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "continue_final_message continues the last message, which a generation prompt would "
            "close: set add_generation_prompt to false",
            "continue_final_message",
        )
    from jinja2 import TemplateError

    kwargs = dict(template_kwargs or {})
    try:
        return tokenizer.apply_chat_template(
            [message_to_dict(m, i) for i, m in enumerate(messages)],
            tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except (TemplateError, TypeError, ValueError, KeyError) as exc:
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc
