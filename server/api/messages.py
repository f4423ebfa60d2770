"""POST /v1/messages: Anthropic's Messages API over the chat path, as vLLM and SGLang serve it, so
that Anthropic's SDKs and tools built on them (Claude Code with ANTHROPIC_BASE_URL) can use the
served model.

A request's `system` and `messages` (text, `tool_use`, `tool_result` and `thinking` blocks) become
chat messages, its `tools` (`input_schema`) and `tool_choice` (`auto`, `any`, `tool`, `none`) the
chat request's, `thinking` the chat template's `enable_thinking`; it then runs as a chat completion
(`chat.prepare_chat`) and its output comes back as Anthropic content blocks, in the order they were
written: `thinking`, `text`, `tool_use`. Streams send Anthropic's events (`message_start`,
`content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`).
`/v1/messages/count_tokens` counts the rendered prompt.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict
from pydantic_core import from_json

from deltaserve.engine.requests.chat_prompt import MAX_ARGUMENTS_DEPTH, nests_deeper

from ..errors import APIError, bad_request, failure_of
from ..protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionDefinition,
    ImageURL,
    RequestBody,
    SamplingRequest,
    ToolDefinition,
    invalid_json_value,
    not_an_object_schema,
    translating,
    unsupported_if_set,
    unsupported_unless_one,
    validated,
)
from ..text.call_readers import ObjectPrefix, is_model_call_id
from ..text.chat_output import ChatStreamState, ended_early
from .chat import PartsWriter, PreparedChat, count_chat_prompt, prepare_chat
from .context import ServerContext
from .request_params import header_name, named_id

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import RequestOutput

# chat fields named otherwise here, for error messages that name the field the client sent
_PARAMS = {"stop": "stop_sequences", "messages": "messages", "max_tokens": "max_tokens"}
# Anthropic's error types by status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


class MessagesRequest(RequestBody):
    model_config = ConfigDict(extra="allow", protected_namespaces=())  # the chat endpoint's extra fields
    unsupported = {
        "mcp_servers": unsupported_if_set("not supported: this server calls no MCP servers"),
        "container": unsupported_if_set("not supported: this server runs no code containers"),
        # the chat endpoint's n, which this API has no place for: one message is one sample
        "n": unsupported_unless_one("not supported: a message is one sample (send one request a sample)"),
        # the chat endpoint's, which a message has no place for: chat completions give them
        "logprobs": unsupported_if_set("not supported here: chat completions give logprobs"),
        "top_logprobs": unsupported_if_set("not supported here: chat completions give logprobs"),
        "logprob_token_ids": unsupported_if_set("not supported here: chat completions give logprobs"),
        "prompt_logprobs": unsupported_if_set("not supported here: chat completions give them"),
        "return_token_ids": unsupported_if_set("not supported here: chat completions return them"),
        "use_beam_search": unsupported_if_set("not supported here: chat completions search beams"),
    }
    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its format: JSON outputs
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name for that format


class CountTokensRequest(RequestBody):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
    return content


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    """The text of text blocks (the system prompt's)."""
    texts = []
    for block in blocks:
        if block.get("type") != "text":
            raise bad_request(
                f"{where}: blocks of type {block.get('type')!r} are not supported (text only)", "messages"
            )
        texts.append(_block_text(block, where))
    return "".join(texts)


def _block_text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):  # not a number's or an object's Python repr in the prompt
        raise bad_request(f"{where}: a text block's text is a string", "messages")
    return text


def to_messages(
    system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if system:
        out.append(
            ChatMessage(role="system", content=system if isinstance(system, str) else _text(system, "system"))
        )
    for i, message in enumerate(messages):
        where, role = f"messages[{i}]", message.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant", "messages")
        texts: list[str] = []
        parts: list[ContentPart] = []  # text and images in order, when the message has images
        calls: list[dict[str, Any]] = []
        thought = None
        for j, block in enumerate(_blocks(message.get("content"), where)):
            kind = block.get("type")
            if kind == "text":
                texts.append(_block_text(block, f"{where}.content[{j}]"))
                parts.append(ContentPart(type="text", text=texts[-1]))
            elif kind == "image" and role == "user":
                parts.append(
                    ContentPart(
                        type="image_url", image_url=ImageURL(url=_image_url(block, f"{where}.content[{j}]"))
                    )
                )
            elif kind == "tool_result" and role == "user":
                is_error = block.get("is_error")
                if is_error is not None and not isinstance(is_error, bool):  # Anthropic's and vLLM's type
                    raise bad_request(
                        f"{where}.content[{j}]: a tool_result's is_error is a boolean", "messages"
                    )
                call_id = block.get("tool_use_id")
                if call_id is not None and not isinstance(call_id, str):  # Anthropic's type
                    raise bad_request(
                        f"{where}.content[{j}]: a tool_result's tool_use_id is a string", "messages"
                    )
                result = _tool_result(block.get("content"), f"{where}.content[{j}]")
                out.append(ChatMessage(role="tool", tool_call_id=call_id, content=result))
            elif kind == "tool_use" and role == "assistant":
                _check_tool_use(block, f"{where}.content[{j}]")
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                call = {"name": block.get("name"), "arguments": arguments}
                calls.append({"id": block.get("id") or _tool_use_id(), "type": "function", "function": call})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                if block.get("thinking") is not None and not isinstance(block["thinking"], str):
                    raise bad_request(
                        f"{where}.content[{j}]: a thinking block's thinking is a string", "messages"
                    )
                thought = block.get("thinking") or thought
            else:
                raise bad_request(
                    f"{where}.content[{j}]: blocks of type {kind!r} are not supported here", "messages"
                )
        if len(parts) > len(texts):  # images among the text: the parts as they came
            out.append(ChatMessage(role=role, content=parts))
        elif texts or calls or thought is not None or role == "user" and not out:
            content = "\n".join(texts) if texts or role == "user" else None  # as vLLM joins them
            out.append(
                ChatMessage(role=role, content=content, tool_calls=calls or None, reasoning_content=thought)
            )
    if not out:
        raise bad_request("messages is empty", "messages")
    return out


def _tool_result(result: Any, where: str) -> str | list[ContentPart]:
    """A tool_result's content as the tool message's: its text, or with images its text and
    image parts in order, as the chat endpoint reads a tool message's parts."""
    if result is None or isinstance(result, str):
        return result or ""
    parts: list[ContentPart] = []
    for k, block in enumerate(_blocks(result, where)):
        if block.get("type") == "image":
            url = _image_url(block, f"{where}.content[{k}]")
            parts.append(ContentPart(type="image_url", image_url=ImageURL(url=url)))
        elif block.get("type") == "text":
            parts.append(ContentPart(type="text", text=_block_text(block, where)))
        else:
            raise bad_request(
                f"{where}: blocks of type {block.get('type')!r} are not supported in a tool_result "
                "(text and images)",
                "messages",
            )
    if any(p.type == "image_url" for p in parts):
        return parts
    return "\n".join(p.text or "" for p in parts)  # as vLLM joins a tool_result's texts


def _check_tool_use(block: dict[str, Any], where: str) -> None:
    """A tool_use block as Anthropic's API takes it: a non-empty string name, a string id, an
    object input (nested no deeper than a chat tool call's arguments may be)."""
    if not isinstance(block.get("name"), str) or not isinstance(block.get("id", ""), str):
        raise bad_request(f"{where}: a tool_use block's name and id are strings", "messages")
    if not block["name"]:  # Anthropic's 400 too (its name has at least 1 character)
        raise bad_request(f"{where}.name: a tool_use block's name is empty", "messages")
    if not isinstance(block.get("input", {}), dict):
        raise bad_request(f"{where}: a tool_use block's input is an object", "messages")
    if nests_deeper(block.get("input"), MAX_ARGUMENTS_DEPTH):
        raise bad_request(
            f"{where}.input: a tool_use block's input nests objects and arrays deeper than "
            f"{MAX_ARGUMENTS_DEPTH} levels",
            "messages",
        )


# Anthropic's image media types, and how each one's file begins
_MEDIA_TYPES: dict[str, Callable[[bytes], bool]] = {
    "image/jpeg": lambda head: head.startswith(b"\xff\xd8\xff"),
    "image/png": lambda head: head.startswith(b"\x89PNG\r\n\x1a\n"),
    "image/gif": lambda head: head.startswith((b"GIF87a", b"GIF89a")),
    "image/webp": lambda head: head[:4] == b"RIFF" and head[8:12] == b"WEBP",
}


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a URL: base64 data (of one of Anthropic's media types, which
    its bytes must be) as a data: URL, or the URL given."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"{where}: an image's source must be base64 data or a url", "messages")
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type")
        if not isinstance(media, str) or media not in _MEDIA_TYPES:
            raise bad_request(
                f"{where}: an image's media_type must be one of {', '.join(_MEDIA_TYPES)}, got {media!r}",
                "messages",
            )
        try:  # the file's first 12 bytes; data that is not base64 is refused where it is decoded
            head = base64.b64decode(source["data"][:16], validate=True)
        except binascii.Error:
            head = None
        if head is not None and not _MEDIA_TYPES[media](head):
            raise bad_request(f"{where}: the image's data is not of its media_type {media}", "messages")
        return f"data:{media};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise bad_request(f"{where}: an image's source must be base64 data or a url", "messages")


def _tools(req: MessagesRequest | CountTokensRequest) -> tuple[list[ToolDefinition] | None, Any, bool]:
    """The chat request's tools, tool choice and whether several calls may come in one turn."""
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") not in (None, "custom") or not isinstance(tool.get("name"), str):
                raise bad_request(
                    f"tools[{i}]: only client tools ({{'name', 'description', 'input_schema'}}) are supported",
                    "tools",
                )
            if not tool["name"]:
                raise bad_request(f"tools[{i}].name must have at least 1 character", f"tools.{i}.name")
            schema = tool.get("input_schema")
            if schema is None:  # Anthropic's 400 too: a client tool's input is what its schema says
                raise bad_request(f"tools[{i}].input_schema: Field required", f"tools.{i}.input_schema")
            why = not_an_object_schema(schema)
            if why is not None:
                raise bad_request(f"tools[{i}].input_schema: {why}", f"tools.{i}.input_schema")
            if tool.get("description") is not None and not isinstance(tool["description"], str):
                raise bad_request(f"tools[{i}].description is a string", f"tools.{i}.description")
            strict = tool.get("strict")  # Anthropic's strict tool use: the input follows its schema
            if strict is not None and not isinstance(strict, bool):
                raise bad_request(f"tools[{i}].strict is a boolean", f"tools.{i}.strict")
            definition = FunctionDefinition(
                name=tool["name"], description=tool.get("description"), parameters=schema, strict=strict
            )
            tools.append(ToolDefinition(function=definition))
    choice: Any = None
    parallel = True
    if req.tool_choice is not None:
        kind = req.tool_choice.get("type")
        single = req.tool_choice.get("disable_parallel_tool_use", False)
        if not isinstance(single, bool):
            raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
        parallel = not single
        if kind == "tool":
            name = req.tool_choice.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request("a named tool_choice is {'type': 'tool', 'name': ...}", "tool_choice")
            choice = {"type": "function", "function": {"name": name}}
        elif kind in ("auto", "any", "none"):
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise bad_request("tool_choice.type must be auto, any, tool or none", "tool_choice")
    return tools, choice, parallel


# Anthropic's least thinking.budget_tokens
MIN_BUDGET_TOKENS = 1024


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """`thinking` as the chat template's switch (Qwen's enable_thinking); None: the template's default."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_request("thinking.type must be enabled, adaptive or disabled", "thinking")
    return {"enable_thinking": kind != "disabled"}


# the chat request's sampling fields a Messages request may add beside Anthropic's (ignore_eos,
# min_tokens, seed, penalties, ...), as vLLM takes them, and those the chat endpoint refuses
# (guided_whitespace_pattern, ...): refused here too, not dropped; not those Anthropic's own fields set
_EXTRA = (set(SamplingRequest.model_fields) | set(SamplingRequest.unsupported)) - {
    "model", "max_tokens", "stop", "stream", "n", "stream_options",
}  # fmt: skip


def _response_format(req: MessagesRequest) -> dict[str, Any] | None:
    """Anthropic's JSON outputs (`output_config.format`, or the beta's `output_format`:
    `{"type": "json_schema", "schema": {...}}`) as the chat request's response_format."""
    fmt = (req.output_config or {}).get("format", req.output_format)
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise bad_request(
            "output_config.format needs {'type': 'json_schema', 'schema': {...}}", "output_config.format"
        )
    if req.model_extra and req.model_extra.get("response_format") is not None:
        raise bad_request("give one of output_config.format and response_format", "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


@translating()
def _chat_fields(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The chat request's prompt fields (messages, tools, tool choice, template switches), which
    /v1/messages and its count_tokens render alike."""
    tools, choice, parallel = _tools(req)
    messages = to_messages(req.system, req.messages)
    last = messages[-1]
    # Anthropic's prefill: a last assistant message of text is the reply's start, which goes on
    prefill = last.role == "assistant" and isinstance(last.content, str) and not last.tool_calls
    return dict(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=_thinking(req.thinking),
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
    )


def _budget_tokens(req: MessagesRequest) -> int | None:
    """`thinking.budget_tokens` of enabled thinking, held to Anthropic's range: at least 1024 and
    below max_tokens. None where thinking is not enabled or sets no budget."""
    thinking = req.thinking or {}
    budget = thinking.get("budget_tokens")
    if thinking.get("type") != "enabled" or budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise bad_request(
            "thinking.enabled.budget_tokens: Input should be a valid integer", "thinking.budget_tokens"
        )
    if budget < MIN_BUDGET_TOKENS:
        raise bad_request(
            f"thinking.enabled.budget_tokens: Input should be greater than or equal to {MIN_BUDGET_TOKENS}",
            "thinking.budget_tokens",
        )
    if budget >= req.max_tokens:
        raise bad_request(
            "`max_tokens` must be greater than `thinking.budget_tokens`", "thinking.budget_tokens"
        )
    return budget


def to_chat_request(req: MessagesRequest, reasoning: bool = True) -> ChatCompletionRequest:
    """The chat request /v1/messages runs as; `reasoning`: the model's tokenizer has `<think>`, so
    that enabled thinking's `budget_tokens` bounds the reasoning (elsewhere it has nothing to bound)."""
    fields = {k: v for k, v in (req.model_extra or {}).items() if k in _EXTRA}
    budget = _budget_tokens(req)
    if budget is not None and fields.get("thinking_token_budget") is not None:
        raise bad_request(
            "give one of thinking.budget_tokens and thinking_token_budget", "thinking.budget_tokens"
        )
    if budget is not None and reasoning:
        fields["thinking_token_budget"] = budget
    fields.update(
        _chat_fields(req),
        max_tokens=req.max_tokens,
        stop=req.stop_sequences,
        stream=req.stream,
        **{k: getattr(req, k) for k in ("temperature", "top_p", "top_k") if getattr(req, k) is not None},
    )
    response_format = _response_format(req)
    if response_format is not None:
        fields["response_format"] = response_format
    return validated(ChatCompletionRequest, fields)


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape (the app's handlers send it for these routes)."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class _Blocks(PartsWriter):
    """The reply's content blocks as its text is read, and the stream events that build them. A
    tool_use block opens once the call's name is written and its input streams as the model writes
    it, as far as it stays the start of a JSON object; a stream cannot take back what it sent, so
    a call the reply ends inside (max_tokens, an abort) keeps its block, its input what was sent as
    Anthropic's SDK reads it, in the whole reply too."""

    reasoning_kind, content_kind = "thinking", "text"

    def __init__(self, message: Callable[[int], dict[str, Any]] | None = None) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # the kind of the last block while it may still grow
        # a stream's message_start message, given the prompt tokens the prefix cache served: sent
        # at the first output, which carries that count (Anthropic's usage counts them there)
        self.message, self.started = message, False
        self.written: list[str] = []  # the open call's arguments as the model wrote them
        self.input: ObjectPrefix | None = None  # ... as its input streams them, until the call ends
        self.sent: list[str] = []  # the open call's input as sent

    def opening(self, first: RequestOutput | None) -> list[str]:
        if self.message is None or self.started:
            return []
        self.started = True
        return [_event("message_start", message=self.message(first.num_cached_tokens if first else 0))]

    def text(self, kind: str, piece: str) -> list[str]:
        events = []
        if self.open != kind:
            events += self.close()
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            events += self._start(kind, block)
        self.blocks[-1][kind] += piece
        delta = (
            {"type": "thinking_delta", "thinking": piece}
            if kind == "thinking"
            else {"type": "text_delta", "text": piece}
        )
        events.append(_event("content_block_delta", index=len(self.blocks) - 1, delta=delta))
        return events

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        self.blocks.append(block)
        self.open = kind
        return [_event("content_block_start", index=len(self.blocks) - 1, content_block=dict(block))]

    def call(self, name: str, call_id: str | None = None) -> list[str]:
        events = self.close()
        tool_id = call_id if is_model_call_id(call_id) else _tool_use_id()
        self.written, self.input, self.sent = [], ObjectPrefix(), []
        return events + self._start(
            "tool_use", {"type": "tool_use", "id": tool_id, "name": name, "input": {}}
        )

    def arguments(self, piece: str) -> list[str]:
        if self.input is None:
            return []
        self.written.append(piece)
        self.input.feed(piece)
        return self._input_delta(self.input.take())

    def _input_delta(self, partial: str) -> list[str]:
        if not partial:
            return []
        self.sent.append(partial)
        delta = {"type": "input_json_delta", "partial_json": partial}
        return [_event("content_block_delta", index=len(self.blocks) - 1, delta=delta)]

    def call_end(self) -> list[str]:
        """The call's input, whole: an object the reply can carry (no NaN), else {}, which a stream
        that sent none of it sends; one that sent the start of an object that broke off keeps it."""
        if self.input is None:
            return []
        self.input = None
        try:
            value = json.loads("".join(self.written))
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict) or invalid_json_value(value) is not None:
            value = {}
        self.blocks[-1]["input"] = value
        return ([] if self.sent else self._input_delta("{}")) + self.close()

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        if self.input is not None:  # a call the reply ended inside: its input as the SDK reads what was sent
            self.input = None
            sent = "".join(self.sent)
            self.blocks[-1]["input"] = from_json(sent, allow_partial=True) if sent else {}
        return [_event("content_block_stop", index=len(self.blocks) - 1)]

    def finish(self) -> list[str]:
        """Close the open block; a reply of nothing gets one empty text block."""
        events = self.close()
        if not any(b["type"] in ("text", "tool_use") for b in self.blocks):
            events += self.text("text", "") + self.close()
        return events


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stop(
    reason: str | None, stop_reason: Any, blocks: list[dict[str, Any]]
) -> tuple[str | None, str | None]:
    if reason == "abort":  # ended by the server: no stop reason of Anthropic's says so (vLLM's null)
        return None, None
    if reason == "length":  # cut, calls or not: as chat's finish reason length (a later call was dropped)
        return "max_tokens", None
    if any(b["type"] == "tool_use" for b in blocks):
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, int]:
    cached = min(cached, prompt_tokens)
    return {
        "input_tokens": prompt_tokens - cached,  # Anthropic's: the prompt less what the cache served
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output_tokens,
    }


def _message(
    message_id: str,
    model: str,
    blocks: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


async def create_message(ctx: ServerContext, req: MessagesRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    try:
        chat = to_chat_request(req, reasoning=ctx.think_end_id is not None)
        prepared = await prepare_chat(ctx, chat, images_at="messages", raw=raw)
    except APIError as exc:  # name the field as this API calls it
        raise exc.renamed(_PARAMS) from exc
    message_id = f"msg_{uuid.uuid4().hex}"
    engine_id = named_id(header_name(raw), message_id)  # this API has no name field
    return await ctx.run(
        [prepared.request(engine_id)],
        raw,
        req.stream,
        lambda group: _stream(group, prepared, message_id, model),
        lambda final: _answer(final[engine_id], prepared, message_id, model),
        [prepared.prompt_ids],
        1,
    )


async def _answer(final: Any, prepared: PreparedChat, message_id: str, model: str) -> Response:
    completion = final.outputs[0]
    blocks = _Blocks()
    blocks.feed(
        *ChatStreamState(prepared.parser).feed_in_order(
            completion.text, True, ended_early(completion.finish_reason)
        )
    )
    blocks.finish()
    stop = _stop(completion.finish_reason, completion.stop_reason, blocks.blocks)
    usage = _usage(len(prepared.prompt_ids), completion.num_tokens, final.num_cached_tokens)
    return JSONResponse(_message(message_id, model, blocks.blocks, stop, usage))


async def _stream(group: Any, prepared: PreparedChat, message_id: str, model: str) -> AsyncIterator[str]:
    prompt_tokens = len(prepared.prompt_ids)
    blocks = _Blocks(
        lambda cached: _message(message_id, model, [], (None, None), _usage(prompt_tokens, 0, cached))
    )
    try:  # an output that failed in the engine ends the stream with an error event
        async for event in blocks.write(group, prepared.parser):
            yield event
    except Exception as exc:  # the engine failed or the server is draining: say so in-band
        for event in blocks.opening(None):
            yield event
        yield _event("error", error=anthropic_error_body(*failure_of(exc))["error"])
        return
    for event in blocks.finish():
        yield event
    assert blocks.last is not None
    completion = blocks.last.outputs[0]
    stop = _stop(completion.finish_reason, completion.stop_reason, blocks.blocks)
    usage = _usage(len(prepared.prompt_ids), completion.num_tokens, blocks.last.num_cached_tokens)
    yield _event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=usage)
    yield _event("message_stop")


async def count_tokens(ctx: ServerContext, req: CountTokensRequest) -> Response:
    """The rendered prompt's tokens, as /v1/messages would send them to the engine; a prompt longer
    than the context is counted too, as Anthropic's count tells a client whether it must shorten one."""
    ctx.resolve_model(req.model)
    chat = validated(ChatCompletionRequest, {**_chat_fields(req), "max_tokens": 1})
    return JSONResponse({"input_tokens": await count_chat_prompt(ctx, chat, images_at="messages")})
