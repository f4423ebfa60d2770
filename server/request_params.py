"""OpenAI request fields -> engine SamplingParams, with OpenAI's ranges and clear 400 messages."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .errors import bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

if TYPE_CHECKING:
    from deltaserve.engine.generation_defaults import SamplingDefaults
    from deltaserve.engine.sampling_params import SamplingParams, StructuredOutputs

MAX_N = 128
MAX_LOGPROBS = 20


def check_range(name: str, value: float | None, low: float, high: float, low_open: bool = False) -> None:
    if value is None:
        return
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise bad_request(f"{name} must be in {bracket}{low:g}, {high:g}], got {value}", name)


def build_sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    prompt_len: int,
    max_model_len: int,
    defaults: SamplingDefaults | None = None,
    vocab_size: int = 0,
) -> SamplingParams:
    """The engine's parameters for one request: the request's values, else `defaults` (the
    checkpoint's generation_config.json, `--generation-config`), else OpenAI's. Token ids
    (stop_token_ids, logit_bias keys) must lie in [0, vocab_size) when it is known (not 0)."""
    from deltaserve.engine.sampling_params import SamplingParams

    check_range("n", req.n, 1, MAX_N)
    check_range("temperature", req.temperature, 0.0, 2.0)
    check_range("top_p", req.top_p, 0.0, 1.0, low_open=True)
    check_range("min_p", req.min_p, 0.0, 1.0)
    check_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    check_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be -1 (off) or positive, got {req.top_k}", "top_k")
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise bad_request(
            f"repetition_penalty must be positive, got {req.repetition_penalty}", "repetition_penalty"
        )
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad_request(f"seed must be a 64-bit integer, got {req.seed}", "seed")
    check_token_ids("stop_token_ids", req.stop_token_ids or [], vocab_size)

    if isinstance(req, ChatCompletionRequest):
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        check_range("top_logprobs", req.top_logprobs, 0, MAX_LOGPROBS)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_name, max_tokens = "max_tokens", req.max_tokens
        check_range("logprobs", req.logprobs, 0, MAX_LOGPROBS)
        logprobs = req.logprobs
    check_range("prompt_logprobs", req.prompt_logprobs, 0, MAX_LOGPROBS)
    prompt_logprobs = req.prompt_logprobs
    echo = isinstance(req, CompletionRequest) and req.echo
    if echo and (logprobs is not None or max_tokens == 0):  # the echoed prompt's log-probabilities
        prompt_logprobs = max(prompt_logprobs or 0, logprobs or 0)
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise bad_request(f"{max_name} must be at least 1 (0 only with echo), got {max_tokens}", max_name)

    if prompt_len < 1:
        raise bad_request(
            "the prompt is empty", "prompt" if isinstance(req, CompletionRequest) else "messages"
        )
    room = max_model_len - prompt_len
    if room < 1 or (max_tokens is not None and max_tokens > room):
        requested = prompt_len + (max_tokens or 1)
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but {requested} tokens were "
            f"requested ({prompt_len} in the prompt, {max_tokens or 1} for the completion); "
            f"shorten the prompt or lower {max_name}",
            max_name if room >= 1 else ("messages" if isinstance(req, ChatCompletionRequest) else "prompt"),
            code="context_length_exceeded",
        )
    if defaults is None:
        from deltaserve.engine.generation_defaults import SamplingDefaults

        defaults = SamplingDefaults()
    if max_tokens is None:
        max_tokens = min(room, defaults.max_tokens) if defaults.max_tokens else room

    logit_bias = _logit_bias(req.logit_bias)
    check_token_ids("logit_bias", list(logit_bias or {}), vocab_size)
    structured = _response_format(req.response_format)
    vllm_style = _vllm_structured(req)
    if structured is not None and vllm_style is not None:
        raise bad_request(
            "give one of response_format and structured_outputs / guided_*", "structured_outputs"
        )
    structured = structured or vllm_style
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop sequences must not be empty", "stop")
    try:
        return SamplingParams(
            n=1,  # the server fans out n itself, see `fan_out`
            temperature=defaults.temperature if req.temperature is None else req.temperature,
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
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=logit_bias,
            # a stream sends what each step adds; a non-streamed response is built from the final output
            output_kind="delta" if req.stream else "final_only",
            structured_outputs=structured,
        )
    except ValueError as exc:
        raise bad_request(str(exc), str(exc).split(" ", 1)[0]) from exc


def _response_format(fmt: dict[str, Any] | None) -> StructuredOutputs | None:
    """OpenAI's response_format: "text" (nothing), "json_object" (any JSON object) or
    "json_schema" (`{"json_schema": {"name": ..., "schema": {...}}}`)."""
    from deltaserve.engine.sampling_params import StructuredOutputs

    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return StructuredOutputs(json_object=True)
        if kind == "json_schema":
            spec = fmt.get("json_schema") if fmt else None
            if not isinstance(spec, dict) or "schema" not in spec:
                raise bad_request(
                    "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                    "response_format",
                )
            return StructuredOutputs(json=spec["schema"])
    except ValueError as exc:
        raise bad_request(str(exc), "response_format") from exc
    raise bad_request(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format"
    )


FORCED_CALLS = 4  # tool_choice "required": at most this many calls in one reply

_VLLM_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _vllm_structured(req: SamplingRequest) -> StructuredOutputs | None:
    """vLLM's `structured_outputs` ({"json": schema} or json_object / regex / choice / grammar)
    and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`."""
    from deltaserve.engine.sampling_params import StructuredOutputs

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
    unknown = set(fields) - set(_VLLM_KINDS)
    if unknown:
        raise bad_request(
            f"structured_outputs takes one of {', '.join(_VLLM_KINDS)}; not {', '.join(sorted(unknown))}",
            "structured_outputs",
        )
    fields = {k: v for k, v in fields.items() if v is not None and v is not False}
    try:
        return StructuredOutputs(**fields)
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), "structured_outputs") from exc


def tool_choice_constraint(
    tool_choice: str | dict[str, Any] | None,
    tools: list[Any] | None,
    prompt: str,
    kimi: bool = False,
    parallel: bool = True,
) -> StructuredOutputs | None:
    """`tool_choice` "required" (one call of any tool) or a named function (one call of it) as a
    grammar over the template's tool-call form (Qwen3's JSON body or Qwen3.5's XML body); None
    for "auto", "none" or no choice.
    `prompt` is the rendered chat prompt, whose tool instructions show the template's form; the
    grammar replaces a response_format's, which holds for the text of later turns; `kimi`: the
    tokenizer has Kimi's tool-call markers (its form, whatever the prompt shows). "required" with
    `parallel` (parallel_tool_calls, true by default) allows up to FORCED_CALLS calls, as vLLM
    allows a list; a named function is called once."""
    from deltaserve.engine.sampling_params import StructuredOutputs

    if tool_choice in (None, "auto", "none"):
        return None
    if isinstance(tool_choice, str) and tool_choice != "required":
        raise bad_request(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
            "tool_choice",
        )
    if not tools:
        raise bad_request("tool_choice other than 'none' or 'auto' needs tools", "tool_choice")
    functions = {t.function.name: t.function.parameters for t in tools}
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or name is None:
            raise bad_request(
                "a named tool_choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice"
            )
        if name not in functions:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        functions = {name: functions[name]}
    # the template's tool instructions show its form: Qwen3.5's XML body, or Qwen3's JSON body
    form = (
        "kimi" if kimi else "xml" if "<function=" in prompt else "json" if "<tool_call>" in prompt else None
    )
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
            max_tool_calls=FORCED_CALLS if tool_choice == "required" and parallel else 1,
        )
    except ValueError as exc:
        raise bad_request(str(exc), "tool_choice") from exc


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    """400 for an id outside [0, vocab_size) (only below 0 while the vocabulary is unknown)."""
    for t in ids:
        if t < 0 or (vocab_size and t >= vocab_size):
            bound = f"the vocabulary [0, {vocab_size})" if vocab_size else "the vocabulary"
            raise bad_request(f"{name}: token id {t} is outside {bound}", name)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids as JSON object keys, biases within [-100, 100]."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if token < 0:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        check_range("logit_bias", value, -100.0, 100.0)
        out[token] = float(value)
    return out


def fan_out(
    base_id: str, prompt_ids: list[int], params: SamplingParams, n: int
) -> list[tuple[str, list[int], SamplingParams]]:
    """n engine requests for one OpenAI request; distinct seeds keep seeded choices distinct."""
    return [
        (f"{base_id}-{i}", prompt_ids, replace(params, seed=None if params.seed is None else params.seed + i))
        for i in range(n)
    ]
