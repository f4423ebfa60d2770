"""A chat's prompt text: messages in OpenAI's shape (plain dicts) through the checkpoint's chat
template, with tools and template keywords (`enable_thinking`) passed on. The server's chat
endpoints and the offline `LLM.chat` render alike."""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any


class ChatTemplateError(ValueError):
    """Messages the template cannot render; `param` names the request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


# a str holds one only where its JSON had an unpaired \uD800-\uDFFF escape: not Unicode, no reply can carry it
SURROGATE = re.compile("[\ud800-\udfff]")

IMAGE_PARTS = ("image_url", "image")

# how deeply a tool call's arguments may nest: the chat template's renderer recurses on each level
MAX_ARGUMENTS_DEPTH = 128


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether `value`'s dicts and lists nest deeper than `limit` levels (walked without
    recursion, as a deep one would overflow it)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def read_part(part: Any) -> Any:
    """A content part as chat reads it. As vLLM's chat (served and offline), the Responses API's
    `input_text` / `output_text` parts are text parts and an `input_image` whose `image_url` is a
    URL string is an `image_url` part; any other part is returned as it came."""
    if not isinstance(part, dict):
        return part
    if part.get("type") in ("input_text", "output_text"):
        return {**part, "type": "text"}
    if part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
        return {**part, "type": "image_url", "image_url": {"url": part["image_url"]}}
    return part


def content_parts(message: dict[str, Any]) -> list[Any]:
    """A message's content parts as chat reads them (`read_part`); none for string content."""
    content = message.get("content")
    return [read_part(part) for part in content] if isinstance(content, list) else []


# the content parts chat reads (after `read_part`); audio, a file or any other is refused, not dropped
READ_PARTS = ("text", "refusal", "image_url")


def check_parts(message: dict[str, Any], index: int) -> None:
    """A ChatTemplateError naming the first content part of `message` (messages[`index`]) that chat
    cannot read: one of another type (audio, a file, an `input_image` with only a `file_id`), a
    text part without its text, an image_url part without its image_url. The server's chat and
    the offline `LLM.chat` refuse alike."""
    for j, part in enumerate(content_parts(message)):
        where, at = f"messages[{index}].content[{j}]", f"messages.{index}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and part.get("text") is None:
            raise ChatTemplateError(f"{where}: a text part needs its text", f"{at}.text")
        if kind not in READ_PARTS or (kind == "image_url" and part.get("image_url") is None):
            if kind == "image_url":
                why = "an image_url part needs its image_url"
            elif kind == "input_image":
                why = "give its image_url (file_id is not supported)"
            else:
                why = "not supported"
            raise ChatTemplateError(f"{where}: content parts of type {kind!r}: {why}", f"{at}.type")


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The URLs of OpenAI-shaped messages' `image_url` parts, in order."""
    return [
        part["image_url"]["url"]
        for m in messages
        for part in content_parts(m)
        if part.get("type") == "image_url" and part.get("image_url")  # one without: refused as it renders
    ]


def _part_text(part: dict[str, Any]) -> str | None:
    return part.get("text") if part.get("type") == "text" else part.get("refusal")


def template_message(message: dict[str, Any], content_format: str = "auto") -> dict[str, Any]:
    """A message as chat templates read it: `developer` as `system`, text parts joined by newlines,
    content never None (templates test it with `in`), tool calls' JSON arguments as mappings.
    `content_format` "openai": the content always as a list of parts, a string as one text part."""
    content = message.get("content")
    if isinstance(content, list):
        content = content_parts(message)
    if content_format == "openai" and not isinstance(content, list):
        content = [] if content is None else [{"type": "text", "text": content}]
    if isinstance(content, list) and (
        content_format == "openai" or any(part.get("type") in IMAGE_PARTS for part in content)
    ):
        # parts in order, as templates that write images read them (Qwen3.5's: {"type": "image"})
        content = [
            {"type": "image"}
            if part.get("type") in IMAGE_PARTS
            else {"type": "text", "text": _part_text(part)}
            for part in content
        ]
    elif isinstance(content, list):
        texts = [_part_text(part) for part in content]
        content = "\n".join(t for t in texts if t is not None)
    out: dict[str, Any] = {
        "role": "system" if message["role"] == "developer" else message["role"],
        "content": content if isinstance(content, list) else content or "",
    }
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [_tool_call_for_template(call, j) for j, call in enumerate(message["tool_calls"])]
    return out


def _tool_call_for_template(call: dict[str, Any], index: int) -> dict[str, Any]:
    # OpenAI sends arguments as a JSON string; Qwen3.5's template iterates them as a mapping, and
    # a string that is not JSON is passed through as it came
    call = dict(call)
    # OpenAI's and vLLM's schema: a string id (a tool message answers it) and type "function"
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise ChatTemplateError(
            f"tool_calls[{index}]: a tool call's id is a string", f"tool_calls.{index}.id"
        )
    if call.get("type") not in (None, "function"):
        raise ChatTemplateError(
            f"tool_calls[{index}]: a tool call's type is 'function', got {call['type']!r}",
            f"tool_calls.{index}.type",
        )
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatTemplateError(
            f"tool_calls[{index}]: a tool call's function is an object with its name (a string)",
            f"tool_calls.{index}.function",
        )
    arguments = function.get("arguments")
    # a missing one reached the template as an undefined, which its tojson cannot write
    if "arguments" not in function or (arguments is not None and not isinstance(arguments, (str, dict))):
        raise ChatTemplateError(
            f"tool_calls[{index}]: a tool call's arguments are a JSON string",
            f"tool_calls.{index}.function.arguments",
        )
    function = dict(function)
    if isinstance(arguments, str):
        function["arguments"] = _decoded_arguments(arguments, index)
    elif nests_deeper(arguments, MAX_ARGUMENTS_DEPTH):  # arguments given as an object
        raise _arguments_error(index, _TOO_DEEP)
    call["function"] = function
    return call


_TOO_DEEP = f"nest objects and arrays deeper than {MAX_ARGUMENTS_DEPTH} levels"


def _arguments_error(index: int, why: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"tool_calls[{index}]: a tool call's arguments {why}", f"tool_calls.{index}.function.arguments"
    )


def _decoded_arguments(arguments: str, index: int) -> Any:
    """A call's JSON arguments as the template reads them (text that is not JSON as it came); a
    ChatTemplateError for JSON that no prompt can hold."""
    try:
        decoded = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    except RecursionError:  # deeper than Python's json follows: deeper than MAX_ARGUMENTS_DEPTH too
        raise _arguments_error(index, _TOO_DEEP) from None
    except ValueError:  # an integer longer than Python's int() reads (4300 digits)
        raise _arguments_error(index, "hold an integer too long to read") from None
    if nests_deeper(decoded, MAX_ARGUMENTS_DEPTH):
        raise _arguments_error(index, _TOO_DEEP)
    if SURROGATE.search(json.dumps(decoded, ensure_ascii=False)):
        why = "hold a lone surrogate (an unpaired \\uD800-\\uDFFF escape), which is not Unicode"
        raise _arguments_error(index, why)
    return decoded


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of `messages`. `continue_final_message`: the text ends with the last
    message's content, its turn left open (no end-of-turn marker), so the model goes on writing that
    message (vLLM's field); `documents`: for templates that render retrieved documents (vLLM's
    field; others ignore them). A ChatTemplateError for what cannot render."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; give one (--chat-template)")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message continues the last message, which a generation prompt would "
            "close: set add_generation_prompt to false",
            "continue_final_message",
        )
    _check_template_kwargs(tokenizer, template_kwargs or {})
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            [template_message(m, content_format) for m in messages],
            tools=tools or None,
            documents=documents or None,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except ChatTemplateError:
        raise
    # RecursionError: objects nested deeper than the renderer's recursion goes (vLLM's 400 too)
    except (TemplateError, TypeError, ValueError, KeyError, RecursionError) as exc:
        raise ChatTemplateError(f"the chat template could not render these messages: {exc}") from exc


# what transformers' renderer passes the template itself, beside apply_chat_template's own parameters
_RENDERER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _check_template_kwargs(tokenizer: Any, template_kwargs: dict[str, Any]) -> None:
    """A template kwarg that would override what the request's own fields set is a ChatTemplateError
    naming it, rather than the renderer's "multiple values" TypeError."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    own = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    for key in template_kwargs:
        if key in own or key in _RENDERER_VARIABLES:
            raise ChatTemplateError(
                f"chat_template_kwargs may not set {key!r}: the server passes it to the template from "
                "the request's own fields",
                f"chat_template_kwargs.{key}",
            )


# what follows a chat's answer in its next request: the answer as an assistant message, then a user
# message (so that the template renders the answer as history, as it will be)
_NEXT_TURN = [{"role": "assistant", "content": ""}, {"role": "user", "content": ""}]


def unrepeated_tail(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    prompt: str,
    *,
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> int:
    """Where in `prompt` (`messages` rendered with the generation prompt) the conversation's next
    request stops repeating it: the part of the generation prompt that the template does not
    write again once the answer comes back as an assistant message (Qwen3.5's `<think>\\n`, the
    empty reasoning block that `enable_thinking` false adds). `len(prompt)` where it repeats it
    all, or where the next turn does not render."""
    try:
        after = render_prompt(
            tokenizer,
            [*messages, *_NEXT_TURN],
            template=template,
            tools=tools,
            add_generation_prompt=False,
            template_kwargs=template_kwargs,
            content_format=content_format,
        )
    except ChatTemplateError:
        return len(prompt)
    return _common_prefix(prompt, after)


def tail_tokens(prompt_ids: list[int], prompt: str, start: int, encode: Any, search: int = 32) -> int:
    """How many of the last `prompt_ids` encode `prompt[start:]`, the start moved back (up to
    `search` characters) to where the text's tokens split; 0 for none."""
    if start >= len(prompt):
        return 0
    for at in range(start, max(-1, start - search), -1):
        ids = encode(prompt[at:])
        if ids and len(ids) < len(prompt_ids) and prompt_ids[len(prompt_ids) - len(ids) :] == ids:
            return len(ids)
    return 0


def shared_head_tokens(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    prompt_ids: list[int],
    encode: Callable[[str], list[int]],
    *,
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> int:
    """How many of `prompt_ids`' first tokens every conversation with `messages`' system (or
    developer) message and tools begins with: those, then an empty user message, rendered without
    a generation prompt (the tools' block, the system prompt, the user turn's header). 0 where that
    does not render."""
    first = [m for m in messages[:1] if m.get("role") in ("system", "developer")]
    try:
        head = render_prompt(
            tokenizer,
            [*first, {"role": "user", "content": ""}],
            template=template,
            tools=tools,
            add_generation_prompt=False,
            template_kwargs=template_kwargs,
            content_format=content_format,
        )
    except ChatTemplateError:
        return 0
    n = 0
    for x, y in zip(prompt_ids, encode(head)):
        if x != y:
            break
        n += 1
    return n


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
