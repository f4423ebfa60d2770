"""Pydantic models of the OpenAI API subset deltaserve speaks. Unknown request fields are ignored, as
OpenAI does, except those that would change the output (`RequestBody.unsupported`); response
models carry exactly OpenAI's field names."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from deltaserve.engine.requests.chat_prompt import SURROGATE, nests_deeper, read_part
from deltaserve.engine.requests.sampling_params import MAX_SCHEMA_DEPTH, WHITESPACE_PATTERN_WHY


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


_PLAIN = {int, bool, type(None)}
_LONE_SURROGATE = "holds a lone surrogate (an unpaired \\uD800-\\uDFFF escape), which is not Unicode"


def _scalar_problem(value: Any) -> str | None:
    if isinstance(value, str):
        return _LONE_SURROGATE if not value.isascii() and SURROGATE.search(value) else None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a finite number"
    return None


def invalid_json_value(data: Any) -> tuple[str, str] | None:
    """The first lone surrogate in a string or a key, or NaN or infinite number, in a parsed JSON
    body, as (its dotted path, what is wrong); None if there is none. Python's json accepts both,
    and neither survives the tokenizer, the sampler or the reply's encoding."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, (list, tuple)):
            if set(map(type, value)) <= _PLAIN:  # token id lists: checked in one pass in C
                continue
            items = enumerate(value)
        else:
            problem = _scalar_problem(value)
            if problem is not None:
                return ".".join(map(str, path)) or "body", problem
            continue
        for key, item in items:
            if isinstance(key, str) and _scalar_problem(key) is not None:
                return ".".join(map(str, path)) or "body", f"a key {_LONE_SURROGATE}"
            if type(item) not in _PLAIN:
                stack.append((item, (*path, key)))
    return None


def _leaf_types(annotation: Any) -> set[Any]:
    """The types a field's annotation is built from (`int | list[int] | None`: int, NoneType)."""
    if get_origin(annotation) is Literal:
        return {Literal}
    args = get_args(annotation)
    return set().union(*map(_leaf_types, args)) if args else {annotation}


def _number_kind(annotation: Any) -> str | None:
    """What a field of numbers that takes no bool holds ("integer" or "number"), else None."""
    leaves = _leaf_types(annotation)
    if leaves & {bool, Any} or not leaves & {int, float}:
        return None
    return "integer" if int in leaves else "number"


def _takes_null(annotation: Any) -> bool:
    return annotation is Any or type(None) in _leaf_types(annotation)


def _holds_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, list):
        kinds = set(map(type, value))  # token id lists: one pass in C
        return bool in kinds or any(_holds_bool(v) for v in value if type(v) in (list, dict))
    if isinstance(value, dict):
        return any(_holds_bool(v) for v in value.values())
    return False


# (field value, whole body) -> why the value cannot be served, or None where it changes nothing
Unsupported = Callable[[Any, dict[str, Any]], str | None]


def unsupported_if_set(why: str) -> Unsupported:
    return lambda value, _: None if value in (None, "", [], {}, False) else why


def unsupported_unless_one(why: str) -> Unsupported:
    """For `n` where the API answers one sample: 1 (or null) changes nothing, any other is refused."""
    return lambda value, _: None if value is None or (not isinstance(value, bool) and value == 1) else why


class RequestBody(OpenAIModel):
    """A request's top-level model. Its whole raw body is checked once, before any field, free-form
    ones (tools, metadata, response_format) included: what the reply echoes must encode too.
    Fields in `unsupported` that would change the output are a 400 naming them, not ignored."""

    unsupported: ClassVar[dict[str, Unsupported]] = {}
    # fields of numbers (max_tokens, n, seed, temperature, token ids ...) -> "integer" or "number"
    _numbers: ClassVar[dict[str, str]] = {}
    # fields whose type has no null (n, stream, logprobs, echo ...): a null is the field left unset
    _not_null: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kinds = {name: _number_kind(f.annotation) for name, f in cls.model_fields.items()}
        cls._numbers = {name: kind for name, kind in kinds.items() if kind is not None}
        cls._not_null = frozenset(n for n, f in cls.model_fields.items() if not _takes_null(f.annotation))

    @model_validator(mode="before")
    @classmethod
    def _valid_json_values(cls, data: Any) -> Any:
        found = invalid_json_value(data)
        if found is not None:
            path, reason = found
            raise PydanticCustomError("invalid_json_value", "{reason}", {"param": path, "reason": reason})
        if isinstance(data, dict):
            # OpenAI's schema makes n, stream, logprobs ... nullable, and clients that write every
            # field send them so (vLLM takes them): null is the default, not a 400
            if any(data[name] is None for name in cls._not_null.intersection(data)):
                data = {k: v for k, v in data.items() if v is not None or k not in cls._not_null}
            for name, kind in cls._numbers.items():
                # pydantic reads true as 1: max_tokens true would be one token, not a 400
                if name in data and _holds_bool(data[name]):
                    raise PydanticCustomError(
                        "bool_not_number",
                        "{reason}",
                        {"param": name, "reason": f"Input should be a valid {kind}, not a boolean"},
                    )
            for name, check in cls.unsupported.items():
                why = check(data[name], data) if name in data else None
                if why is not None:
                    raise PydanticCustomError("unsupported", "{reason}", {"param": name, "reason": why})
        return data


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], fields: dict[str, Any]) -> M:
    """`model` built from `fields` another API's request was translated into, its refusal a 400
    as the app's own validation gives it."""
    from .errors import bad_request, validation_message

    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))  # type: ignore[arg-type]
        raise bad_request(message, param) from exc


@contextmanager
def translating() -> Iterator[None]:
    """Models built from another API's request (the Responses and Messages APIs' items and tools
    as chat messages and tools): a field of the wrong type is a 400 naming it, as `validated`
    gives it, not an internal error."""
    from .errors import bad_request, validation_message

    try:
        yield
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))  # type: ignore[arg-type]
        raise bad_request(message, param) from exc


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------------------- requests


MAX_NAME_CHARS = 256  # of a client's name for its request: every chunk of its stream repeats it in its id
ClientName = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk too

    @model_validator(mode="before")
    @classmethod
    def _nulls_unset(cls, data: Any) -> Any:
        # OpenAI's and vLLM's schemas take null here, as the field left unset
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def not_an_object_schema(schema: Any) -> str | None:
    """Why a function's parameters schema is refused: its arguments are a JSON object (the tool-call
    forms write them so), so a schema of another type is an error, as OpenAI's and Anthropic's are
    (and a schema that is no JSON object at all)."""
    if schema is not None and not isinstance(schema, dict):
        return "not an object"
    kind = (schema or {}).get("type", "object")
    if kind != "object":
        return f"a function's parameters are a JSON Schema of type 'object', got type {kind!r}"
    # the chat template's renderer recurses on each level: a deeper one is its recursion error
    if nests_deeper(schema, MAX_SCHEMA_DEPTH):
        return f"the schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels"
    return None


def _object_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    why = not_an_object_schema(schema)
    if why is not None:
        raise PydanticCustomError("invalid_parameters", "{reason}", {"reason": why})
    return schema


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)  # a call names its function: "" would name none
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(_object_schema)] = None
    # OpenAI's: the call's arguments follow `parameters` exactly, under tool_choice "auto" too
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def _distinct_names(tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
    """Tools whose function names differ: a call names its function, and a forced call's grammar
    and the reply's parser hold one definition a name."""
    seen: set[str] = set()
    for tool in tools or []:
        if tool.function.name in seen:
            raise PydanticCustomError(
                "duplicate_tool_name",
                "tool names must be unique; {name} names two",
                {"name": repr(tool.function.name)},
            )
        seen.add(tool.function.name)
    return tools


Tools = Annotated[list[ToolDefinition] | None, AfterValidator(_distinct_names)]


def _renderable_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    # the template's renderer recurses on each level of what it is passed, as on a tool's schema
    if nests_deeper(kwargs, MAX_SCHEMA_DEPTH):
        raise PydanticCustomError(
            "too_deep", "nests objects and arrays deeper than {limit} levels", {"limit": MAX_SCHEMA_DEPTH}
        )
    return kwargs


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_renderable_kwargs)]


class ImageURL(OpenAIModel):
    url: str
    detail: str | None = None  # OpenAI's; the vision tower reads every image at its own resolution


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None
    refusal: str | None = None  # a "refusal" part of an earlier assistant turn
    image_url: ImageURL | None = None  # an "image_url" part: a data: or http(s): URL

    @model_validator(mode="before")
    @classmethod
    def _responses_parts(cls, data: Any) -> Any:
        # the Responses API's parts, read as the offline LLM.chat reads them (one parser)
        return read_part(data)


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


_SALT_FORBIDDEN = frozenset("@/\\\x00")  # vLLM's validate_cache_salt refuses these


def _cache_salt(salt: str | None) -> str | None:
    if salt is not None and _SALT_FORBIDDEN.intersection(salt):
        raise PydanticCustomError("invalid_cache_salt", "must not contain '@', '/', '\\' or NUL, as in vLLM")
    return salt


def _guided_decoding_backend(value: Any, _: dict[str, Any]) -> str | None:
    if value in (None, "", "auto", "xgrammar"):
        return None
    return f"{value!r} is not supported: this server decodes structured outputs with xgrammar alone"


class SamplingRequest(RequestBody):
    """Fields shared by chat and completions; their values are checked by the engine's
    `SamplingParams` (`request_params.py` translates them and names the field in a 400)."""

    # vLLM's fields that would change the output and are not implemented (or, for the older
    # guided ones, that xgrammar cannot honour)
    unsupported: ClassVar[dict[str, Unsupported]] = {
        "guided_whitespace_pattern": unsupported_if_set(WHITESPACE_PATTERN_WHY),
        "guided_decoding_backend": _guided_decoding_backend,
        "structural_tag": unsupported_if_set("not supported: send response_format or structured_outputs"),
        "repetition_detection": unsupported_if_set(
            "not supported: this server does not end repetitive output"
        ),
        "watermarking": unsupported_if_set("not supported: this server does not watermark its output"),
        "logits_processors": unsupported_if_set(
            "not supported: this server runs no custom logits processors"
        ),
        "mm_processor_kwargs": unsupported_if_set(
            "not supported: images are read at the processor's settings"
        ),
        "media_io_kwargs": unsupported_if_set("not supported: images are read at the server's settings"),
    }

    model: str | None = None
    max_tokens: int | None = None
    # vLLM's: the prompt tokens' log-probabilities with this many alternatives each, in the reply
    prompt_logprobs: int | None = None
    # vLLM's: keep the prompt's last this many tokens (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = None
    # vLLM's: "left" (the default) drops the prompt's start, keeping its last tokens; "right" its end
    truncation_side: Literal["left", "right"] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower values run first
    # vLLM's: prefix-cache hits only from requests with the same salt; vLLM's 400s for one it refuses
    cache_salt: Annotated[str | None, Field(min_length=1, max_length=128), AfterValidator(_cache_salt)] = None
    request_id: ClientName | None = (
        None  # vLLM's: the reply's id after its prefix (an X-Request-Id header wins)
    )
    rid: ClientName | None = None  # SGLang's name for it
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's; the detokenizer joins special tokens as the tokenizer's decode does, either way
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    # vLLM's: at each generated position, these ids' logprobs (with the chosen one's) as its top ones
    logprob_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens `token_id:N`
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the reply
    bad_words: list[str] | None = None  # vLLM's: words never generated
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema
    # vLLM's constrained decoding: {"json" | "json_object" | "regex" | "choice" | "grammar": ...},
    # and its older per-kind fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: a stream's chunks after the first carry this many tokens (the server's --stream-interval at least)
    stream_interval: int | None = None
    # vLLM's: at most this many tokens of reasoning, then </think> is forced (-1: unlimited)
    thinking_token_budget: int | None = None
    user: str | None = None

    @field_validator("stream_options", mode="before")
    @classmethod
    def _empty_options_unset(cls, value: Any) -> Any:
        # vLLM tests the object's truthiness: {} on an unstreamed request is served, not a 400
        return None if value == {} else value


def _modalities(value: Any, _: dict[str, Any]) -> str | None:
    if isinstance(value, list) and all(m == "text" for m in value):
        return None
    return "not supported: this server writes text only"


def _best_of(value: Any, data: dict[str, Any]) -> str | None:
    if value is None or value == data.get("n", 1):
        return None
    return "not supported other than equal to n: this server returns every sequence it samples"


class ChatCompletionRequest(SamplingRequest):
    unsupported = {
        **SamplingRequest.unsupported,
        "audio": unsupported_if_set("not supported: this server writes text only"),
        "modalities": _modalities,
        "web_search_options": unsupported_if_set("not supported: this server does not search the web"),
        "functions": unsupported_if_set("not supported (legacy function calling): send tools"),
        "function_call": unsupported_if_set("not supported (legacy function calling): send tool_choice"),
        "best_of": _best_of,  # vLLM's older chat requests took it as completions do
    }
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Tools = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # with tool_choice "required": more than one call allowed
    chat_template_kwargs: TemplateKwargs = None
    chat_template: str | None = None  # only with --trust-request-chat-template, as vLLM's
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the last message
    use_beam_search: bool = False  # vLLM's: the n best beams (server/api/beam_search.py)
    length_penalty: float = 1.0  # vLLM's: beams score their log-probability over length ** this
    # OpenAI's, as vLLM reads it: passed to the template, whose thinking "none" turns off
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the reply
    # vLLM's: the reply's content starts with the last message's, where its role is the reply's
    echo: bool = False
    return_prompt_text: bool = False  # vLLM's: the rendered prompt's text in the reply
    # vLLM's: for templates that render retrieved documents ({"title": ..., "text": ...})
    documents: list[dict[str, str]] | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) added to the rendered prompt, beside the template's
    add_special_tokens: bool = False

    def reply_role(self) -> str:
        """vLLM's: the reply is the assistant's after a generation prompt, else the last message's role."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed(self) -> str:
        """vLLM's `echo`: the last message's text where its role is the reply's (the assistant's
        with a generation prompt, else the last message's own), which the reply's content starts with."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        if isinstance(last.content, list):  # text parts, joined as the template reads them
            return "\n".join(p.text for p in last.content if p.type == "text" and p.text is not None)
        return last.content or ""

    @model_validator(mode="after")
    def _effort_to_template(self) -> ChatCompletionRequest:
        if self.reasoning_effort is not None:  # the request's own chat_template_kwargs win
            self.chat_template_kwargs = {
                "reasoning_effort": self.reasoning_effort,
                "enable_thinking": self.reasoning_effort != "none",
                **(self.chat_template_kwargs or {}),
            }
        return self


class CompletionRequest(SamplingRequest):
    unsupported = {
        **SamplingRequest.unsupported,
        "suffix": unsupported_if_set("not supported: this server does not fill in the middle"),
        "best_of": _best_of,
        "prompt_embeds": unsupported_if_set("not supported: send the prompt as text or token ids"),
    }
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16  # OpenAI's default for the legacy completions endpoint, a null's too (as vLLM's)
    logprobs: int | None = None
    echo: bool = False
    use_beam_search: bool = False  # vLLM's: the n best beams (server/api/beam_search.py)
    length_penalty: float = 1.0
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) added to a text prompt


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: true for a text prompt, false for messages (the template writes its own)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    tools: Tools = None  # rendered into the prompt as chat renders them
    return_token_strs: bool = False  # vLLM's: the reply adds each id's token string


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# a weight version is a label that /get_model_info and /get_weight_version report back
WeightVersion = Annotated[str, Field(max_length=256)]


class UpdateWeightsFromDiskRequest(RequestBody):
    """SGLang's /update_weights_from_disk body."""

    model_path: str
    load_format: Literal["auto", "dummy"] | None = None
    flush_cache: bool = True  # the cache always goes: the old weights computed it
    weight_version: WeightVersion | None = None  # the new weights' label (/get_weight_version)
    # end the running requests (finish reason "abort") instead of waiting for them to finish
    abort_all_requests: bool = False


class UpdateWeightVersionRequest(RequestBody):
    """SGLang's /update_weight_version body: a new label for the weights served."""

    new_version: WeightVersion
    abort_all_requests: bool = False


class AbortRequest(RequestBody):
    """SGLang's /abort_request body: one /generate request by its `rid`, or every request."""

    rid: str = ""
    abort_all: bool = False


# ---------------------------------------------------------------------------------------- responses


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class Usage(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class WithTokenIds(OpenAIModel):
    """A reply part with vLLM's token id (and prompt text) fields, which it leaves out where they are
    null (the request did not ask for them, or a stream's later chunks), as other servers' replies lack them."""

    _token_id_fields: ClassVar[tuple[str, ...]] = ("token_ids", "prompt_token_ids", "prompt_text")

    @model_serializer(mode="wrap")
    def _without_null_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._token_id_fields:
            if name in data and data[name] is None:
                del data[name]
        return data


class ToolCallFunction(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: ToolCallFunction


class DeltaToolCall(OpenAIModel):
    """A call's part of a stream chunk: the first carries its id, type and name, the next ones
    fragments of its arguments; a field without news is left out, as OpenAI's stream does."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields = {k: v for k, v in handler(self).items() if v is not None}
        fields["function"] = {k: v for k, v in fields["function"].items() if v is not None}
        return fields


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(OpenAIModel):
    role: str = "assistant"  # the last message's without a generation prompt, as in vLLM
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(WithTokenIds):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class PromptLogprob(OpenAIModel):
    """One candidate at a prompt position, keyed by its token id (vLLM's `prompt_logprobs`)."""

    logprob: float
    rank: int | None = None  # 1 for the most likely; None where the prompt's token is not a top one
    decoded_token: str


class ChatCompletionResponse(WithTokenIds):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when asked
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids
    prompt_text: str | None = None  # vLLM's, with return_prompt_text: the rendered prompt


class ChatDelta(OpenAIModel):
    """What a chat stream chunk adds; a field without news is left out, not sent as null."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(WithTokenIds):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the tokens this chunk adds


class ChatCompletionChunk(WithTokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: in the first chunk
    prompt_text: str | None = None  # vLLM's, with return_prompt_text: in the first chunk


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(WithTokenIds):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when asked
    # vLLM's, with return_token_ids: the prompt's (a stream's first chunk) and the generated tokens
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelPermission(OpenAIModel):
    """The permission entry of a model card, as vLLM (and OpenAI's older API) lists it."""

    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deltaserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model in vLLM; none are served here
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
