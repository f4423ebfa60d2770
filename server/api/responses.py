"""POST /v1/responses: OpenAI's Responses API over the chat path.

A request's `instructions` and `input` (a string, or messages, `reasoning`, `function_call` and
`function_call_output` items) become chat messages; its function tools, `tool_choice` and
`text.format` become the chat request's tools, tool choice and response format; then it runs as
a chat completion does (`chat.prepare_chat`), and the output is given back as Responses items: a
`reasoning` item (the `<think>` section), a `message` with `output_text`, and one
`function_call` per tool call. Streams send the Responses events (`response.created`, the items'
`added` / delta / `done` events, `response.completed`, or `response.incomplete` for a reply that
max_output_tokens cut or the server aborted: status `incomplete` or `cancelled`). Responses are kept in memory (the last
`STORE_SIZE` within `STORE_BYTES`, unless the request says `store: false`; with several HTTP
processes, in files of a folder they share: `SharedResponseStore`): `previous_response_id` continues one (its
input and output items come before the new input), `GET` / `DELETE /v1/responses/{id}` read and
drop one, and `GET /v1/responses/{id}/input_items` lists the items it was made from. A restart forgets them all.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict

from deltaserve.engine.sized_lru import SizedLRU

from ..errors import APIError, bad_request, error_body, failure_of, quoted
from ..protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    ImageURL,
    RequestBody,
    SamplingRequest,
    TemplateKwargs,
    not_an_object_schema,
    translating,
    unsupported_if_set,
    unsupported_unless_one,
    validated,
)
from ..text.call_readers import is_model_call_id
from ..text.chat_output import ChatStreamState, ended_early, tool_call_id
from .chat import PartsWriter, PreparedChat, prepare_chat
from .context import ClientDisconnected, ServerContext
from .logprobs import chat_logprobs, token_text_for
from .request_params import header_name, named_id

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import Logprob, RequestOutput

# chat fields named otherwise here, for error messages that name the field the client sent
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


# reasoning.effort's values (the SDK's, and chat's reasoning_effort's); "none" turns the chat
# template's thinking off, as in vLLM
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
REASONING_SUMMARIES = ("auto", "concise", "detailed")  # OpenAI's; echoed, no summary is written
# OpenAI's includable outputs; of these this server writes message.output_text.logprobs alone
LOGPROBS = "message.output_text.logprobs"
Includable = Literal[
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs",
]  # fmt: skip
# the chat request's sampling fields a Responses request may add beside OpenAI's (stop, penalties,
# logit_bias, ignore_eos, structured_outputs, ...), as vLLM's Responses API takes them, and those
# it refuses (guided_whitespace_pattern, ...): refused here too, not dropped
_EXTRA = (set(SamplingRequest.model_fields) | set(SamplingRequest.unsupported)) - {
    "model", "max_tokens", "n", "priority", "response_format", "seed", "stream", "stream_options",
    "temperature", "top_k", "top_p", "user", "request_id", "rid", "prompt_logprobs",
}  # fmt: skip


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(extra="allow", protected_namespaces=())  # the chat endpoint's extra fields
    unsupported = {
        "background": unsupported_if_set("not supported: responses are answered in the request"),
        "conversation": unsupported_if_set("not supported: continue with previous_response_id"),
        "prompt": unsupported_if_set("not supported: this server stores no prompt templates"),
        "logprob_token_ids": unsupported_if_set("not supported here: chat completions give logprobs"),
        "logprobs": unsupported_if_set(f"not supported here: include {LOGPROBS!r} asks for them"),
        "use_beam_search": unsupported_if_set("not supported here: chat completions search beams"),
        "prompt_logprobs": unsupported_if_set("not supported here: chat completions give them"),
        "return_token_ids": unsupported_if_set("not supported here: chat completions return them"),
        # the chat endpoint's n, which this API has no place for: one response is one sample
        "n": unsupported_unless_one("not supported: a response is one sample (send one request a sample)"),
    }
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # beyond OpenAI's fields, as vLLM accepts them
    seed: int | None = None
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower values run first
    chat_template_kwargs: TemplateKwargs = None  # e.g. {"enable_thinking": false}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True  # kept for previous_response_id and GET (OpenAI's default)
    metadata: dict[str, str] | None = None  # OpenAI's: string values
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # effort "none": the template's thinking off
    # echoed; an input over the context is a 400 either way
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Includable] | None = None
    # with include's message.output_text.logprobs: each token's this many alternatives, as vLLM's
    top_logprobs: int | None = None


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _content_of(content: Any, where: str, assistant: bool = False) -> str | list[ContentPart]:
    """A message's content: a string, or text parts joined by newlines, or, with images among them, the parts
    in order (an `input_image`'s `image_url`, a data: or http(s): URL). An `assistant` turn's
    `refusal` parts (an earlier response's output) are its text, as chat reads them."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    parts: list[ContentPart] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append(ContentPart(type="image_url", image_url=ImageURL(url=part["image_url"])))
        elif kind in ("input_text", "output_text", "text") or (kind == "refusal" and assistant):
            key = "refusal" if kind == "refusal" else "text"
            if not isinstance(part.get(key), str):  # not a number's or an object's repr in the prompt
                raise bad_request(
                    f"{where}: a content part of type {kind!r} needs its {key} (a string)", "input"
                )
            parts.append(ContentPart(type="text", text=part[key]))
        else:
            why = (
                "give its image_url (file_id is not supported)" if kind == "input_image" else "not supported"
            )
            raise bad_request(f"{where}: content parts of type {kind!r}: {why}", "input")
    if any(p.type == "image_url" for p in parts):
        return parts
    return "\n".join(p.text or "" for p in parts)  # as chat joins a message's text parts (vLLM's too)


STORE_SIZE = 1024  # responses kept for previous_response_id and GET
# and within this many bytes of their text: an input item may hold a 30 MB image data URL
STORE_BYTES = 256 << 20


@dataclass
class StoredResponse:
    items: list[dict[str, Any]]  # the conversation: every input item, then the output items
    body: dict[str, Any]
    nbytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.nbytes = _text_bytes([self.items, self.body])


def _text_bytes(value: Any) -> int:
    """About what `value`'s strings take in memory (what a stored response's size is made of)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
            total += 64 * len(v)
        elif isinstance(v, list):
            stack.extend(v)
            total += 8 * len(v)
    return total


class ResponseStore:
    """The last `size` responses within `max_bytes`, in memory (least recently stored or used
    dropped first; the newest is kept whatever its size). Used from the server's event loop only."""

    def __init__(self, size: int = STORE_SIZE, max_bytes: int = STORE_BYTES) -> None:
        self.size, self.max_bytes = size, max_bytes
        self._entries: SizedLRU[str, StoredResponse] = SizedLRU(max_bytes, size)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries.put(response_id, entry, entry.nbytes)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id) is not None


class SharedResponseStore(ResponseStore):
    """As ResponseStore, for several HTTP processes: each response a file in a folder they share
    (the kernel hands a client's next connection to any of them), the least recently stored or
    used files dropped first, by their count and size. Used from each server's event loop only."""

    def __init__(self, folder: str, size: int = STORE_SIZE, max_bytes: int = STORE_BYTES) -> None:
        super().__init__(size, max_bytes)
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def _path(self, response_id: str) -> str:
        # a digest, not the id: a GET's id comes from the URL and must not name another file
        return os.path.join(self.folder, hashlib.sha256(response_id.encode()).hexdigest() + ".pkl")

    def put(self, response_id: str, entry: StoredResponse) -> None:
        path = self._path(response_id)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)  # another process reads the whole entry or none
        self._used(path)
        self._evict(keep=path)

    def get(self, response_id: str) -> StoredResponse | None:
        path = self._path(response_id)
        try:
            with open(path, "rb") as f:
                entry: StoredResponse = pickle.load(f)
            self._used(path)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None
        return entry

    @staticmethod
    def _used(path: str) -> None:
        # to the nanosecond: a file system's own stamps tie files written within a clock tick
        now = time.time_ns()
        os.utime(path, ns=(now, now))

    def delete(self, response_id: str) -> bool:
        try:
            os.remove(self._path(response_id))
        except FileNotFoundError:
            return False
        return True

    def _evict(self, keep: str) -> None:
        files = []
        with os.scandir(self.folder) as entries:
            for e in entries:
                if e.name.endswith(".pkl") and e.path != keep:
                    try:
                        st = e.stat()
                    except FileNotFoundError:  # another process dropped it meanwhile
                        continue
                    files.append((st.st_mtime_ns, st.st_size, e.path))
        files.sort()
        count = len(files) + 1
        total = sum(size for _, size, _ in files) + os.path.getsize(keep)
        for _, size, path in files:
            if count <= self.size and total <= self.max_bytes:
                break
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            count, total = count - 1, total - size


# an input item's id, where the client gave none, by its type (OpenAI's prefixes)
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items, each with an id (for GET .../input_items and its `after`)."""
    if isinstance(req.input, str):
        given: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": req.input}]
    else:
        given = list(req.input)
    return [
        item
        if isinstance(item.get("id"), str) and item["id"]
        else {**item, "id": _item_id(_ID_PREFIXES.get(item.get("type", "message"), "item"))}
        for item in given
    ]


def _as_listed(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists it: a message's string content as one text part."""
    if item.get("type", "message") != "message":
        return item
    content = item.get("content")
    if isinstance(content, str):
        if item.get("role") == "assistant":
            content = [{"type": "output_text", "text": content, "annotations": []}]
        else:
            content = [{"type": "input_text", "text": content}]
    return {"type": "message", "status": "completed", **item, "content": content}


def list_input_items(
    entry: StoredResponse, after: str | None, limit: int, order: str, include: list[str]
) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: OpenAI's page of the items the response was made from
    (earlier turns' input and output too), `order` "desc" (newest first) or "asc"."""
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be between 1 and 100, got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {quoted(order)}", "order")
    unknown = [value for value in include if value not in get_args(Includable)]
    if unknown:
        raise bad_request(
            f"include: {quoted(unknown[0])} is not one of {list(get_args(Includable))}", "include"
        )
    items = entry.items[: len(entry.items) - len(entry.body["output"])]
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise bad_request(f"after: no input item {quoted(after)} in this response", "after")
        items = items[ids.index(after) + 1 :]
    page = [_as_listed(item) for item in items[:limit]]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def _reasoning_of(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary's."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
    ):
        raise bad_request(
            f"{where}: a reasoning item's content and summary are lists of parts with text", "input"
        )
    return "\n".join(p["text"] for p in parts)  # as vLLM joins a reasoning item's parts


@dataclass
class Origins:
    """The conversation item each chat message came from (None: the instructions), and each of
    its tool calls, by (message, call): for errors that name the item, not the chat turn."""

    first: int = 0  # the request's input[0] among the items (earlier ones: previous_response_id's)
    messages: list[int | None] = field(default_factory=list)
    calls: dict[tuple[int, int], int] = field(default_factory=dict)

    def where(self, item: int) -> str:
        if item < self.first:  # checked when it was stored: no request's error should come here
            return f"the previous response's item {item}"
        return f"input[{item - self.first}]"


# a chat tool call's fields as a function_call item names them
_CALL_FIELDS = {"function.arguments": "arguments", "function.name": "name", "id": "call_id"}


def name_input_item(exc: APIError, origins: Origins) -> None:
    """A chat turn's error (`messages[M]...`, or `messages[M].tool_calls[J]`, param
    `messages.M.tool_calls.J.function.arguments`) as the input item it came from (`input[K]`,
    `input[K].arguments`), in the message; `param` is `input`, as for the items' own errors."""
    found = re.fullmatch(r"messages\.(\d+)(?:\.tool_calls\.(\d+))?(?:\.(.+))?", exc.param or "")
    if found is None:
        if exc.param is not None and exc.param.startswith("messages."):  # a chat turn is no item's index
            exc.param = "input"
        return
    turn, call, rest = int(found[1]), found[2], found[3] or ""
    if call is None:
        chat_where = f"messages[{turn}]"
        item = origins.messages[turn] if turn < len(origins.messages) else None
        ours = "instructions" if item is None else origins.where(item)
    else:
        chat_where = f"messages[{turn}].tool_calls[{call}]"
        item = origins.calls.get((turn, int(call)))
        field_name = _CALL_FIELDS.get(rest)
        ours = "input" if item is None else origins.where(item) + (f".{field_name}" if field_name else "")
    exc.message = exc.message.replace(chat_where, ours, 1)
    exc.args = (exc.message,)
    exc.param = "instructions" if ours == "instructions" else "input"


def to_messages(
    instructions: str | None, items: list[dict[str, Any]], origins: Origins | None = None
) -> list[ChatMessage]:
    """The conversation's chat messages; `origins` (its `first` set) is filled with where each
    came from."""
    origins = origins if origins is not None else Origins()
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
        origins.messages.append(None)
    # a reasoning item's text, for the assistant turn it begins: the template shows it or drops it
    thought: str | None = None
    for i, item in enumerate(items):
        where = origins.where(i)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant", "input")
            content = _content_of(item.get("content"), where, assistant=role == "assistant")
            reasoning = thought if role == "assistant" else None
            messages.append(ChatMessage(role=role, content=content, reasoning_content=reasoning))
            origins.messages.append(i)
            thought = None
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not all(
                isinstance(item.get(k, ""), str) for k in ("call_id", "arguments")
            ):
                raise bad_request(
                    f"{where}: a function_call item's name, call_id and arguments are strings", "input"
                )
            if not item["name"]:  # OpenAI's 400 too: a call to no function
                raise bad_request(f"{where}.name: a function_call item's name is empty", "input")
            call = {
                "id": item.get("call_id") or tool_call_id(),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
            }
            last = messages[-1] if messages else None
            if (
                thought is None
                and last is not None
                and last.role == "assistant"
                and not isinstance(last.content, list)
            ):
                # the turn's text or parallel calls: one assistant turn, as the model wrote it
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(
                    ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning_content=thought)
                )
                origins.messages.append(i)
            origins.calls[(len(messages) - 1, len(messages[-1].tool_calls or []) - 1)] = i
            thought = None
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # the tool's content parts, as a message's
                content = _content_of(output, where)
            elif isinstance(output, str):
                content = output
            else:  # OpenAI's and vLLM's 400 too: not a number's or an object's JSON in the prompt
                raise bad_request(
                    f"{where}.output: a function_call_output item's output is a string or a list of "
                    "content parts",
                    "input",
                )
            if not isinstance(item.get("call_id", ""), str):
                raise bad_request(f"{where}: a function_call_output item's call_id is a string", "input")
            messages.append(ChatMessage(role="tool", tool_call_id=item.get("call_id"), content=content))
            origins.messages.append(i)
            thought = None
        elif kind == "reasoning":
            text = _reasoning_of(item, where)
            if text:  # an empty one (its text not kept) gives the turn no reasoning
                thought = (thought or "") + text
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", "input")
    if not messages:
        raise bad_request("input has no messages", "input")
    return messages


@translating()
def to_chat_request(
    req: ResponsesRequest, items: list[dict[str, Any]], origins: Origins | None = None
) -> ChatCompletionRequest:
    """The chat request of a response whose conversation is `items` (earlier turns included);
    `origins` as `to_messages` fills it."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise bad_request(
                    f"only function tools ({{'type': 'function', 'name': ...}}) are supported, got {t.get('type')!r}",
                    "tools",
                )
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise bad_request(f"tools[{i}]: a function tool needs a name", "tools")
            strict = t.get("strict")  # echoed; OpenAI's and vLLM's type
            if strict is not None and not isinstance(strict, bool):
                raise bad_request(f"tools[{i}]: a function tool's strict is a boolean", "tools")
            # checked here, where the tool's fields have this API's names, not the chat function's
            if t.get("description") is not None and not isinstance(t["description"], str):
                raise bad_request(f"tools[{i}].description is a string", f"tools.{i}.description")
            schema = t.get("parameters")
            why = not_an_object_schema(schema)
            if why is not None:
                raise bad_request(f"tools[{i}].parameters: {why}", f"tools.{i}.parameters")
            function = {
                "name": t["name"],
                "description": t.get("description"),
                "parameters": t.get("parameters"),
                "strict": strict,
            }
            tools.append({"type": "function", "function": function})
    choice: str | dict[str, Any] | None = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise bad_request("a named tool_choice is {'type': 'function', 'name': ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = (req.text or {}).get("format")
    response_format = None
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise bad_request("text.format must be an object", "text.format")
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise bad_request(
                    "text.format json_schema needs {'type': 'json_schema', 'name': ..., 'schema': {...}}",
                    "text.format",
                )
            spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
            response_format = {"type": "json_schema", "json_schema": spec}
        else:
            response_format = fmt
    template_kwargs = req.chat_template_kwargs
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(
                f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                "reasoning.effort",
            )
        template_kwargs = {"enable_thinking": effort != "none", **(template_kwargs or {})}
    for key in ("summary", "generate_summary"):  # generate_summary: OpenAI's older name for summary
        summary = (req.reasoning or {}).get(key)
        if summary is not None and summary not in REASONING_SUMMARIES:
            raise bad_request(
                f"reasoning.{key} must be one of {', '.join(REASONING_SUMMARIES)}, got {summary!r}",
                f"reasoning.{key}",
            )
    fields = {k: v for k, v in (req.model_extra or {}).items() if k in _EXTRA}
    fields.update(
        model=req.model,
        messages=to_messages(req.instructions, items, origins),
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        tools=tools,
        tool_choice=choice,
        response_format=response_format,
        chat_template_kwargs=template_kwargs,
        parallel_tool_calls=req.parallel_tool_calls,
        stream=req.stream,  # a stream's engine outputs are each step's delta
        priority=req.priority,
    )
    if LOGPROBS in (req.include or []):  # vLLM's: top_logprobs without it asks for nothing
        fields.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return validated(ChatCompletionRequest, fields)


def _status(finish_reason: str | None) -> str:
    """The response's status: cut by max_output_tokens, ended by the server (an abort), or done."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")


# a stream's last event by status: OpenAI's stream has no event of its own for a cancelled response
_DONE_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.incomplete"}  # fmt: skip


def _usage(prompt_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        # cache_write_tokens: the SDK's type requires it; this server's prefix cache bills no writes
        "input_tokens_details": {"cached_tokens": min(cached, prompt_tokens), "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        # the reasoning text's tokens, counted again (a token that spans </think> is not split)
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
        "total_tokens": prompt_tokens + output_tokens,
    }


class _Shell:
    """The response object's fields that do not depend on the output."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.id = _item_id("resp")
        self.created = int(time.time())
        self.req = req
        self.model = model

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": (req.reasoning or {}).get("effort"),
                "summary": (req.reasoning or {}).get("summary"),
            },
            "store": req.store,
            "temperature": req.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "top_logprobs": req.top_logprobs,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }


# reasoning and message items open empty, for their text to stream in
def _reasoning_item(item_id: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": ""}],
        "status": "in_progress",
    }


def _message_item(item_id: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": "", "annotations": []}
    return {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": [part]}


def _call_item(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id or tool_call_id(),
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


async def create_response(
    ctx: ServerContext, req: ResponsesRequest, raw: Request, store: ResponseStore
) -> Response:
    model = ctx.resolve_model(req.model)
    items = input_items(req)
    origins = Origins()
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise bad_request(
                f"no response {quoted(req.previous_response_id)} is stored (this server keeps the last "
                f"{store.size} within {store.max_bytes >> 20} MiB in memory, not those made with store "
                "false, nor any from before a restart)",
                "previous_response_id",
            )
        items = previous.items + items
        origins.first = len(previous.items)
    chat = to_chat_request(req, items, origins)
    try:
        prepared = await prepare_chat(ctx, chat, images_at="input", raw=raw)
    except APIError as exc:  # name the field as this API calls it
        exc.renamed(_PARAMS)
        name_input_item(exc, origins)
        raise
    shell = _Shell(req, model)
    engine_id = named_id(header_name(raw), shell.id)  # this API has no name field
    group = await ctx.submit([prepared.request(engine_id)], raw=raw)

    def keep(body: dict[str, Any]) -> None:
        if req.store:
            store.put(shell.id, StoredResponse(items + body["output"], body))

    logprobs = _logprob_entries(ctx, chat) if chat.logprobs else None
    if req.stream:
        events = _Events(logprobs)
        return StreamingResponse(
            ctx.guarded(group, _stream(ctx, group, prepared, shell, keep, events)),
            media_type="text/event-stream",
        )
    try:
        final = (await ctx.collect(group, raw))[engine_id]
    except ClientDisconnected:
        return Response(status_code=499)
    completion = final.outputs[0]
    # the items as a stream of the whole text builds them: in the order they were written
    items_of = _Events(logprobs)
    items_of.take(completion.logprobs)
    cut = ended_early(completion.finish_reason)
    items_of.feed(*ChatStreamState(prepared.parser).feed_in_order(completion.text, True, cut))
    status = _status(completion.finish_reason)
    items_of.finish(status)
    thought = items_of.reasoning_text()
    reasoning_tokens = len(ctx.encode(thought)) if thought else 0
    usage = _usage(len(prepared.prompt_ids), completion.num_tokens, final.num_cached_tokens, reasoning_tokens)
    body = shell.body(status, items_of.output, usage)
    keep(body)
    return JSONResponse(body)


def _logprob_entries(
    ctx: ServerContext, chat: ChatCompletionRequest
) -> Callable[[list[Logprob]], list[dict[str, Any]]]:
    """Tokens' output_text logprobs entries (include's message.output_text.logprobs): chat's
    `content[]` entries, the shape of OpenAI's and vLLM's."""
    token_text = token_text_for(chat, ctx.token_text)

    def entries(logprobs: list[Logprob]) -> list[dict[str, Any]]:
        content = chat_logprobs(logprobs, chat.top_logprobs or 0, token_text).content or []
        return [entry.model_dump() for entry in content]

    return entries


def _event_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """output_text logprobs entries as the text events' type has them: an output_text part's
    entries hold each token's bytes, the delta and done events' do not (nor do vLLM's)."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]],
        }
        for e in entries
    ]


def _event(kind: str, seq: int, **fields: Any) -> str:
    payload = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Events(PartsWriter):
    """Numbered Responses events and the output items they build, opened as their text arrives."""

    reasoning_kind, content_kind = "reasoning", "message"

    def __init__(self, logprobs: Callable[[list[Logprob]], list[dict[str, Any]]] | None = None) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, int] = {}  # "reasoning" / "message" / "call" -> its item's index, while open
        self.logprobs = logprobs  # a token's output_text logprobs entry, where include asks for them
        self.pending: list[dict[str, Any]] = []  # tokens' entries no text delta has carried yet

    def step(self, out: RequestOutput) -> None:
        self.take(out.outputs[0].logprobs)

    def take(self, logprobs: list[Logprob] | None) -> None:
        if self.logprobs is not None and logprobs:
            self.pending += self.logprobs(logprobs)

    def carry(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        """The pending entries, now part of the output_text `part` (every token's, reasoning's and
        markup's too, as vLLM's output_text holds them), as a text event's logprobs."""
        carried, self.pending = self.pending, []
        if "logprobs" in part:
            part["logprobs"] += carried
        return _event_logprobs(carried)

    def emit(self, kind: str, **fields: Any) -> str:
        event = _event(kind, self.seq, **fields)
        self.seq += 1
        return event

    def text(self, kind: str, piece: str) -> list[str]:
        """A piece of reasoning or message text: opens its item (closing the other) and sends a delta."""
        events = self.close("message" if kind == "reasoning" else "reasoning") + self.close("call")
        index = self.open.get(kind)
        if index is None:
            if kind == "reasoning":
                item = _reasoning_item(_item_id("rs"))
            else:
                item = _message_item(_item_id("msg"))
                if self.logprobs is not None:
                    item["content"][0]["logprobs"] = []
            self.output.append(item)
            index = self.open[kind] = len(self.output) - 1
            events.append(self.emit("response.output_item.added", output_index=index, item=_empty(item)))
            part = item["content"][0]
            events.append(
                self.emit(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part={**part, "text": ""},
                )
            )
        item = self.output[index]
        item["content"][0]["text"] += piece
        ref = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            events.append(self.emit("response.reasoning_text.delta", **ref, delta=piece))
        else:  # logprobs: the SDK's type requires the list, empty unless include asks for them
            logprobs = self.carry(item["content"][0])
            events.append(self.emit("response.output_text.delta", **ref, delta=piece, logprobs=logprobs))
        return events

    def close(self, kind: str, status: str = "completed") -> list[str]:
        index = self.open.pop(kind, None)
        if index is None:
            return []
        item = self.output[index]
        item["status"] = status
        if kind == "call":
            ref = {"item_id": item["id"], "output_index": index}
            return [
                self.emit("response.function_call_arguments.done", **ref, arguments=item["arguments"]),
                self.emit("response.output_item.done", output_index=index, item=item),
            ]
        part = item["content"][0]
        ref = {"item_id": item["id"], "output_index": index, "content_index": 0}
        events: list[str] = []
        # tokens of no text since the last delta (a call's markup, an end token): a delta of no text carries them
        if kind == "message" and self.pending:
            events.append(self.emit("response.output_text.delta", **ref, delta="", logprobs=self.carry(part)))
        done = (
            self.emit("response.reasoning_text.done", **ref, text=part["text"])
            if kind == "reasoning"
            else self.emit(
                "response.output_text.done",
                **ref,
                text=part["text"],
                logprobs=_event_logprobs(part.get("logprobs", [])),
            )
        )
        return events + [
            done,
            self.emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]

    def finish(self, response_status: str) -> list[str]:
        """Close the open items, "incomplete" unless the response completed (cut by
        max_output_tokens or aborted: as OpenAI marks the item it stopped); a reply of no text and
        no call gets an empty message."""
        status = "completed" if response_status == "completed" else "incomplete"
        events = self.close("reasoning", status) + self.close("message", status) + self.close("call", status)
        messages = [item for item in self.output if item["type"] == "message"]
        if messages:  # tokens after a call that closed the last message join it too (its events have passed)
            self.carry(messages[-1]["content"][0])
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self.text("message", "") + self.close("message", status)
        return events

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")

    def call(self, name: str, call_id: str | None = None) -> list[str]:
        events = self.close("reasoning") + self.close("message") + self.close("call")
        item = _call_item(name, "", call_id if is_model_call_id(call_id) else None)
        item["status"] = "in_progress"
        self.output.append(item)
        index = self.open["call"] = len(self.output) - 1
        return events + [self.emit("response.output_item.added", output_index=index, item=dict(item))]

    def arguments(self, piece: str) -> list[str]:
        index = self.open["call"]
        item = self.output[index]
        item["arguments"] += piece
        return [
            self.emit(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=piece
            )
        ]

    def call_end(self) -> list[str]:
        return self.close("call")


def _empty(item: dict[str, Any]) -> dict[str, Any]:
    """An item as first announced: its content parts not yet there."""
    return {**item, "content": []}


async def _stream(
    ctx: ServerContext,
    group: Any,
    prepared: PreparedChat,
    shell: _Shell,
    keep: Callable[[dict[str, Any]], None],
    events: _Events,
) -> AsyncIterator[str]:
    yield events.emit("response.created", response=shell.body("in_progress", [], None))
    yield events.emit("response.in_progress", response=shell.body("in_progress", [], None))
    try:  # an output that failed in the engine ends the stream with an error event
        async for e in events.write(group, prepared.parser):
            yield e
    except Exception as exc:  # the engine failed or the server is draining: say so in-band
        body = error_body(*failure_of(exc))["error"]
        yield events.emit("error", code=body["type"], message=body["message"], param=None)
        return
    assert events.last is not None
    completion = events.last.outputs[0]
    status = _status(completion.finish_reason)
    for e in events.finish(status):
        yield e
    thought = events.reasoning_text()
    reasoning_tokens = len(ctx.encode(thought)) if thought else 0
    usage = _usage(
        len(prepared.prompt_ids), completion.num_tokens, events.last.num_cached_tokens, reasoning_tokens
    )
    body = shell.body(status, events.output, usage)
    keep(body)
    yield events.emit(_DONE_EVENTS[status], response=body)
