"""OpenAI request fields -> engine SamplingParams. The values are checked by SamplingParams alone;
this module translates fields and names them in the 400s as the request spells them."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import bad_request, quoted, refused
from ..protocol import MAX_NAME_CHARS, ChatCompletionRequest, CompletionRequest, SamplingRequest

if TYPE_CHECKING:
    from deltaserve.engine.requests.generation_defaults import SamplingDefaults
    from deltaserve.engine.requests.sampling_params import SamplingParams, StructuredOutputs
    from deltaserve.models.vision.positions import ImageInputs

    from ..engine_client import EngineRequest


def build_sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    prompt_len: int,
    max_model_len: int,
    defaults: SamplingDefaults | None = None,
    vocab_size: int = 0,
    warn: bool = True,
    greedy_copies: bool = False,
) -> SamplingParams:
    """The engine's parameters for one request: the request's values, else `defaults` (the
    checkpoint's generation_config.json, `--generation-config`), else OpenAI's. `SamplingParams`
    checks the values; its refusal is a 400 naming the field as this request spells it. Token ids
    (stop_token_ids, logit_bias keys) must lie in [0, vocab_size) when it is known (not 0).
    `warn` False: a temperature below the floor is raised without the log's warning (a batch's
    later prompts, which the first one's warning covers). `greedy_copies`: n > 1 at temperature 0
    is served (SGLang's /generate), not the 400 of vLLM's OpenAI endpoints."""
    from deltaserve.engine.errors import InvalidParamError
    from deltaserve.engine.requests.sampling_params import SamplingParams, floored

    if isinstance(req, ChatCompletionRequest):
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs and not req.logprobs:  # vLLM's: 0 asks for nothing, so it is taken
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        names = {"logprobs": "top_logprobs", "max_tokens": max_name}
    else:
        max_name, max_tokens, logprobs = "max_tokens", req.max_tokens, req.logprobs
        names = {}
    if req.stream_options is not None and not req.stream:  # OpenAI's and vLLM's 400
        raise bad_request("stream_options are only for a streamed request (stream true)", "stream_options")
    prompt_logprobs = req.prompt_logprobs
    if req.stream and prompt_logprobs == 0:  # vLLM's: accepted; no chunk reports them, so none are computed
        prompt_logprobs = None
    if prompt_logprobs is not None and req.stream:  # a stream's chunks have no place for them (vLLM's 400)
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if isinstance(req, ChatCompletionRequest) and req.echo and not req.stream and prompt_logprobs is None:
        # vLLM's: a chat echo scores the prompt at top_logprobs (0 unless sent); max_tokens 0 stays a 400
        if max_tokens != 0:
            prompt_logprobs = req.top_logprobs if "top_logprobs" in req.model_fields_set else 0
    echo = isinstance(req, CompletionRequest) and req.echo
    _check_asked(req, logprobs, echo and max_tokens == 0)
    # the echoed prompt's log-probabilities (a negative count is left for the check to refuse)
    if echo and (logprobs is not None or max_tokens == 0) and (prompt_logprobs or 0) >= 0:
        prompt_logprobs = max(prompt_logprobs or 0, logprobs or 0)
    if max_tokens == 0 and prompt_logprobs is None and (req.stream or req.use_beam_search):
        # the engine's "0 only with prompt_logprobs" would be untrue here: neither reports them
        why = "use_beam_search reports no" if req.use_beam_search else "a stream reports no"
        raise bad_request(f"{max_name} must be at least 1: {why} prompt_logprobs, got 0", max_name)
    if req.logprob_token_ids:  # vLLM's: the asked ids stand in for the top ones at generated tokens
        logprobs = 0
    if defaults is None:
        from deltaserve.engine.requests.generation_defaults import SamplingDefaults

        defaults = SamplingDefaults()
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    temperature = defaults.temperature if req.temperature is None else req.temperature
    if not warn:
        temperature = floored(temperature)  # as SamplingParams raises it, quietly
    try:
        params = SamplingParams(
            n=req.n,  # the server fans out n itself, see `fan_out`
            temperature=temperature,
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            top_k=defaults.top_k if req.top_k is None else req.top_k,
            min_p=defaults.min_p if req.min_p is None else req.min_p,
            repetition_penalty=defaults.repetition_penalty
            if req.repetition_penalty is None
            else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logprob_token_ids=req.logprob_token_ids,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=_logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            # a stream sends what each step adds; a non-streamed response is built from the final output
            output_kind="delta" if req.stream else "final_only",
            structured_outputs=_structured_outputs(req),
            priority=req.priority,
            cache_salt=req.cache_salt,
            stream_interval=req.stream_interval,
            thinking_token_budget=req.thinking_token_budget,
        )
        if vocab_size:
            params.check_vocab(vocab_size)
        room = _room(req, prompt_len, max_model_len, max_tokens, max_name)
        if max_tokens is None:
            params = replace(
                params, max_tokens=min(room, defaults.max_tokens) if defaults.max_tokens else room
            )
    except InvalidParamError as exc:
        raise refused(exc).renamed(names) from exc
    if params.n > 1 and params.temperature == 0 and not (req.use_beam_search or greedy_copies):
        # vLLM's 400: greedy samples are n copies of one reply (a positive temperature is floored above 0)
        raise bad_request(f"n must be 1 when using greedy sampling (temperature 0), got {params.n}", "n")
    return params


def _check_asked(
    req: ChatCompletionRequest | CompletionRequest, logprobs: int | None, no_output: bool
) -> None:
    """vLLM's 400s for `logprob_token_ids`: empty, without logprobs (where they are reported), or
    with an echo that generates nothing."""
    asked = req.logprob_token_ids
    if asked is None:
        return
    if not asked:
        raise bad_request("logprob_token_ids must not be an empty list", "logprob_token_ids")
    if no_output:
        raise bad_request(
            "logprob_token_ids is not supported with echo and max_tokens 0: no tokens are generated",
            "logprob_token_ids",
        )
    if logprobs is None:
        needs = "true" if isinstance(req, ChatCompletionRequest) else "set"
        raise bad_request(
            f"logprob_token_ids needs logprobs {needs}: they are reported there", "logprob_token_ids"
        )


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's bad words as token sequences (`sampling_params.bad_words_token_ids`); a blank one
    is a 400."""
    from deltaserve.engine.errors import InvalidParamError
    from deltaserve.engine.requests.sampling_params import bad_words_token_ids as tokenized

    try:
        return tokenized(words, encode)
    except InvalidParamError as exc:
        raise bad_request(str(exc), "bad_words") from exc


def truncate_prompt(req: SamplingRequest, ids: list[int], max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: the context's length), or
    its first k with `truncation_side` "right"; a 400 for other values and for k past the context."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    elif k < 1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (the context length) or positive, got {k}",
            "truncate_prompt_tokens",
        )
    elif k > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens ({k}) exceeds this model's maximum context length ({max_model_len})",
            "truncate_prompt_tokens",
        )
    if len(ids) <= k:
        return ids
    return ids[:k] if req.truncation_side == "right" else ids[-k:]


def _room(
    req: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None,
    max_name: str,
) -> int:
    """The tokens the context leaves after the prompt; a 400 where the prompt and max_tokens do not fit."""
    prompt_name = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if prompt_len < 1:
        raise bad_request("the prompt is empty", prompt_name)
    room = max_model_len - prompt_len
    # max_tokens 0 (prompt logprobs only) generates nothing: the prompt may fill the context
    completion = 1 if max_tokens is None else max_tokens
    if completion > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but {prompt_len + completion} "
            f"tokens were requested ({prompt_len} in the prompt, {completion} for the completion); "
            f"shorten the prompt or lower {max_name}",
            max_name if room >= min(completion, 1) else prompt_name,
            code="context_length_exceeded",
        )
    return room


def structured_field(req: SamplingRequest) -> str:
    """The request's field its grammar came from, for a 400 that the grammar cannot compile."""
    if (req.response_format or {}).get("type", "text") != "text":
        return "response_format"
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            return name
    return "structured_outputs"


def _structured_outputs(req: SamplingRequest) -> StructuredOutputs | None:
    """The grammar of OpenAI's response_format or of vLLM's fields; a 400 for both at once.
    vLLM's options alone (disable_any_whitespace) apply to the response_format's, as in vLLM."""
    structured = _response_format(req.response_format)
    given = req.structured_outputs
    if (
        structured is not None
        and isinstance(given, dict)
        and all(given.get(k) in (None, False) for k in _VLLM_KINDS)
    ):
        try:  # the kinds' nulls too, as a client that sends every field writes them
            return replace(
                structured, **_vllm_options({k: v for k, v in given.items() if k not in _VLLM_KINDS})
            )
        except (TypeError, ValueError) as exc:
            raise bad_request(str(exc), "structured_outputs") from exc
    vllm_style = _vllm_structured(req)
    if structured is not None and vllm_style is not None:
        raise bad_request(
            "give one of response_format and structured_outputs / guided_*", "structured_outputs"
        )
    return structured or vllm_style


def _response_format(fmt: dict[str, Any] | None) -> StructuredOutputs | None:
    """OpenAI's response_format: "text" (nothing), "json_object" (any JSON object) or
    "json_schema" (`{"json_schema": {"name": ..., "schema": {...}}}`)."""
    from deltaserve.engine.requests.sampling_params import StructuredOutputs

    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            schema = fmt.get("schema") if fmt else None
            # Together's and Fireworks' JSON mode takes a schema beside the type: held, not ignored
            return StructuredOutputs(json_object=True) if schema is None else StructuredOutputs(json=schema)
        if kind == "json_schema":
            spec = fmt.get("json_schema") if fmt else None
            if not isinstance(spec, dict) or "schema" not in spec:
                raise bad_request(
                    "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                    "response_format",
                )
            _check_schema_spec(spec)
            return StructuredOutputs(json=spec["schema"])
    except ValueError as exc:
        raise bad_request(str(exc), "response_format") from exc
    raise bad_request(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format"
    )


def _check_schema_spec(spec: dict[str, Any]) -> None:
    """A json_schema's name and description strings and strict a boolean, as OpenAI's and vLLM's
    schemas take them (the name required, the others may be left out)."""
    if spec.get("name") is None:
        raise bad_request("response_format json_schema needs its name (a string)", "response_format")
    for key, kind, what in (
        ("name", str, "a string"),
        ("description", str, "a string"),
        ("strict", bool, "a boolean"),
    ):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise bad_request(
                f"response_format json_schema's {key} is {what}, got {type(spec[key]).__name__}",
                "response_format",
            )


_HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None
FORCED_CALLS = 4  # tool_choice "required": at most this many calls in one reply

_VLLM_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# how the kind's grammar is written (StructuredOutputs' fields of the same names)
_VLLM_OPTIONS = (
    "disable_any_whitespace",
    "whitespace_pattern",
    "disable_fallback",
    "disable_additional_properties",
)


def _vllm_options(given: dict[str, Any]) -> dict[str, Any]:
    """structured_outputs' options, with nothing else in it; a 400 naming a field it does not take."""
    given = dict(given)
    if given.pop("structural_tag", None) is not None:  # vLLM's, written null by clients that send every field
        raise bad_request("structured_outputs structural_tag is not supported", "structured_outputs")
    unknown = set(given) - set(_VLLM_OPTIONS)
    if unknown:
        raise bad_request(
            f"structured_outputs takes one of {', '.join(_VLLM_KINDS)} and {', '.join(_VLLM_OPTIONS)}; "
            f"not {', '.join(sorted(unknown))}",
            "structured_outputs",
        )
    return {k: v for k, v in given.items() if v is not None}


def _vllm_structured(req: SamplingRequest) -> StructuredOutputs | None:
    """vLLM's `structured_outputs` ({"json": schema} or json_object / regex / choice / grammar)
    and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`."""
    from deltaserve.engine.requests.sampling_params import StructuredOutputs

    legacy = {
        "json": req.guided_json,
        "regex": req.guided_regex,
        "choice": req.guided_choice,
        "grammar": req.guided_grammar,
    }
    legacy = {k: v for k, v in legacy.items() if v is not None}
    given = req.structured_outputs
    if given is not None and legacy:
        raise bad_request("give structured_outputs or a guided_* field, not both", "structured_outputs")
    if given is None and not legacy:
        return None
    fields = dict(given) if given is not None else legacy
    options = _vllm_options({k: v for k, v in fields.items() if k not in _VLLM_KINDS})
    fields = {k: v for k, v in fields.items() if k in _VLLM_KINDS and v is not None and v is not False}
    fields.update(options)
    param = "structured_outputs" if given is not None else f"guided_{next(iter(legacy))}"
    try:
        return StructuredOutputs(**fields)
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), param) from exc


def tool_choice_constraint(
    tool_choice: str | dict[str, Any] | None,
    tools: list[Any] | None,
    prompt: str,
    kimi: bool = False,
    parallel: bool = True,
) -> StructuredOutputs | None:
    """`tool_choice` "required" (one call of any tool) or a named function (one call of it) as a
    grammar over the template's tool-call form (Qwen3's JSON body or Qwen3.5's XML body); "auto"
    (or no choice) with a `strict` tool as free text whose calls are held to the form and the
    strict tools' schemas (OpenAI's strict, vLLM's too); None for "none", or "auto" without.
    `prompt` is the rendered chat prompt, whose tool instructions show the template's form; the
    grammar replaces a response_format's, which holds for the text of later turns; `kimi`: the
    tokenizer has Kimi's tool-call markers (its form, whatever the prompt shows). "required" with
    `parallel` (parallel_tool_calls, true by default) allows up to FORCED_CALLS calls, as vLLM
    allows a list; a named function is called once."""
    from deltaserve.engine.requests.sampling_params import StructuredOutputs

    # the template's tool instructions show its form: Qwen3.5's XML body, or Qwen3's JSON body
    form = (
        "kimi" if kimi else "xml" if "<function=" in prompt else "json" if "<tool_call>" in prompt else None
    )
    optional = tool_choice in (None, "auto")
    strict = any(t.function.strict for t in tools or [])
    # "auto" decodes freely where nothing is strict, or without xgrammar (`.[structured]`) to hold it
    if tool_choice == "none" or (optional and (form is None or not strict or not _HAS_XGRAMMAR)):
        return None
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "required"):
        raise bad_request(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
            "tool_choice",
        )
    if not tools:
        raise bad_request("tool_choice other than 'none' or 'auto' needs tools", "tool_choice")
    functions = {
        t.function.name: _held(t.function, form) if optional else t.function.parameters for t in tools
    }
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise bad_request(
                "a named tool_choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice"
            )
        if name not in functions:
            raise bad_request(
                f"tool_choice names {quoted(name)}, which is not among the tools", "tool_choice"
            )
        functions = {name: functions[name]}
    if form is None:
        raise bad_request(
            "tool_choice 'required' or a named function needs a chat template with Qwen's <tool_call> "
            "form (a JSON or an XML body), and this model's template shows none",
            "tool_choice",
        )
    try:
        return StructuredOutputs(
            tool_calls=[{"name": n, "parameters": p} for n, p in functions.items()],
            tool_call_form=form,
            max_tool_calls=FORCED_CALLS if not isinstance(tool_choice, dict) and parallel else 1,
            optional_tool_calls=optional,
        )
    except ValueError as exc:
        raise bad_request(str(exc), "tool_choice") from exc


def _held(function: Any, form: str | None) -> dict[str, Any] | None:
    """The schema a call's arguments are held to under tool_choice "auto": a strict function's
    parameters; any object for the others (in the XML form, their parameters' names, in their
    order, each free text)."""
    if function.strict:
        return function.parameters
    if form != "xml":
        return {"type": "object"}
    names = (function.parameters or {}).get("properties") or {}
    return {"type": "object", "properties": {name: {"title": name} for name in names}}


_TOKEN_KEY = re.compile(r"-?(0|[1-9][0-9]*)")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, token ids as JSON object keys, as token ids (their range is checked
    with the other values); a bias beyond [-100, 100] is clamped to it, as vLLM's server does."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        # digits alone, no leading zero: int() also reads " 5", "+5", "05", "5_0" (token 50), "٥"
        try:
            if not _TOKEN_KEY.fullmatch(key):
                raise ValueError(key)
            token = int(key)  # a ValueError past Python's 4,300 digits too
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {quoted(key)}", "logit_bias") from None
        out[token] = min(100.0, max(-100.0, float(value)))  # the body's NaN and infinities are 400s already
    return out


def client_name(raw: Any, req: SamplingRequest) -> str | None:
    """The name a client gave its request: vLLM's X-Request-Id header (which wins) or body
    `request_id`, or SGLang's `rid`."""
    return header_name(raw) or req.request_id or req.rid


def header_name(raw: Any) -> str | None:
    """vLLM's X-Request-Id header, a request's name; a 400 past `MAX_NAME_CHARS`, as in the body."""
    header = raw.headers.get("x-request-id")
    if header is not None and len(header) > MAX_NAME_CHARS:
        raise bad_request(
            f"the X-Request-Id header has more than {MAX_NAME_CHARS} characters ({len(header)})"
        )
    return header


def named_id(name: str | None, request_id: str) -> str:
    """An engine id under the client's name for the request, when it gave one, so that
    /abort_request finds it by that name."""
    return rid_prefix(name) + request_id if name else request_id


def rid_prefix(rid: str) -> str:
    """How the engine ids of a request the client named start (SGLang's `rid`, vLLM's
    `request_id` or X-Request-Id), so that /abort_request finds them by that name (its length
    first: no name's prefix is another name's)."""
    return f"rid{len(rid)}:{rid}:"


def fan_out(
    base_id: str, prompt_ids: list[int], params: SamplingParams, images: ImageInputs | None = None
) -> list[EngineRequest]:
    """One engine request per choice (`params.n`); distinct seeds keep seeded choices distinct.
    A prompt's images ride along as a fourth field."""
    from deltaserve.engine.requests.sampling_params import choice_seed

    requests: list[EngineRequest] = []
    for i in range(params.n):
        choice = replace(params, n=1, seed=choice_seed(params.seed, i))
        requests.append(
            (f"{base_id}-{i}", prompt_ids, choice)
            if images is None
            else (f"{base_id}-{i}", prompt_ids, choice, images)
        )
    return requests
