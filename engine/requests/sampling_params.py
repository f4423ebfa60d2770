"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, cast

from deltaserve.engine.errors import InvalidParamError
from deltaserve.engine.requests.chat_prompt import SURROGATE, nests_deeper

logger = logging.getLogger(__name__)

OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# OpenAI's bounds, held here so that the HTTP API and the offline API refuse the same values
MAX_N = 128
MAX_TEMPERATURE = 2.0
# vLLM's floor: a positive temperature below it is raised to it (dividing by less risks inf and NaN)
MIN_TEMPERATURE = 0.01


def floored(temperature: float) -> float:
    """`temperature` raised to MIN_TEMPERATURE where it is positive and below it."""
    return MIN_TEMPERATURE if 0 < temperature < MIN_TEMPERATURE else temperature


MAX_LOGPROBS = 20


# how deeply a JSON schema's objects and arrays may nest: a deeper one could not be pickled to the
# engine process (Python's recursion limit), and xgrammar's compile time grows with the cube of it
MAX_SCHEMA_DEPTH = 128


def grammar_timeout_s() -> float:
    """How long a request waits for its grammar to compile (`DELTASERVE_GRAMMAR_TIMEOUT`, SGLang's
    SGLANG_GRAMMAR_TIMEOUT): xgrammar cannot stop a compile, and some schemas take it minutes."""
    value = os.environ.get("DELTASERVE_GRAMMAR_TIMEOUT", "") or "300"
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"DELTASERVE_GRAMMAR_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


# every running copy of a request searches each of these at every step: bounded, so that one
# request cannot slow every other request's steps
MAX_STOP = 64
MAX_STOP_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 64
MAX_LOGIT_BIAS = 1024  # entries: each copy's biases are gathered on the host at every step
# vLLM's bound on logprob_token_ids: a generated token's values are one gather of its logits row
MAX_LOGPROB_TOKEN_IDS = 128
# vLLM's bound on prompt_logprob_token_ids (its max_logprobs): every prompt position reports the
# ids' values, built on the engine's thread
MAX_PROMPT_LOGPROB_TOKEN_IDS = MAX_LOGPROBS


# why structured_outputs.whitespace_pattern (and vLLM's older guided_whitespace_pattern) is refused
WHITESPACE_PATTERN_WHY = (
    "not supported: xgrammar writes JSON with fixed separators (`, ` and `: `), not whitespace of a "
    "pattern; structured_outputs {'disable_any_whitespace': true} writes JSON with no whitespace"
)


def _structured(message: str) -> InvalidParamError:
    return InvalidParamError(f"structured outputs: {message}", "structured_outputs")


def _too_deep_error() -> InvalidParamError:
    return _structured(f"the JSON schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels")


@dataclass
class StructuredOutputs:
    """Constrain the output (vLLM's `StructuredOutputsParams`, OpenAI's response_format): `json` a
    JSON schema (a dict or its text) the output must satisfy, `json_object=True` any JSON object,
    `regex`, `choice` or an EBNF `grammar`. Decoded with xgrammar's token masks
    (`engine/sampling/structured.py`)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    # one tool call of one of these functions, [{"name": ..., "parameters": JSON schema}]
    # (tool_choice), in the model's form `tool_call_form`: "json" (Qwen3: `<tool_call>\n{"name": ...,
    # "arguments": {...}}\n</tool_call>`), "xml" (Qwen3.5: `<tool_call>\n<function=NAME>\n
    # <parameter=P>\nvalue\n</parameter>\n...</function>\n</tool_call>`) or "kimi" (Kimi-Linear:
    # `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
    # {...}<|tool_call_end|><|tool_calls_section_end|>`)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_form: str = "json"
    max_tool_calls: int = 1  # with tool_calls: up to this many calls, back to back (at least one)
    # with tool_calls (tool_choice auto with strict tools): free text, and the calls the model opens
    # in it held to the form (one with max_tool_calls 1, else Qwen's any number, Kimi's up to it)
    optional_tool_calls: bool = False
    regex: str | None = None  # the output matches this regular expression (whole)
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # the output is a sentence of this EBNF grammar (xgrammar's dialect)
    # the grammar starts after this token: the output's first tokens are free up to and including
    # it (the end of a reasoning section, `</think>`, when the prompt opened one); None: at once
    after_token: int | None = None
    # vLLM's: JSON (json, json_object) with no whitespace between its tokens, `{"a":1,"b":[2]}`;
    # otherwise json.dumps' separators `, ` and `: ` (and no other whitespace either way)
    disable_any_whitespace: bool = False
    # vLLM's (its outlines backend's): a regex of the whitespace between JSON's tokens; xgrammar
    # writes fixed separators, so a pattern is refused rather than ignored ("" is the default)
    whitespace_pattern: str | None = None
    # vLLM's: no other backend on a schema this one cannot serve; there is none to fall back to
    disable_fallback: bool = False
    # vLLM's: an object whose schema does not say whether it takes properties beyond those it
    # names takes none (xgrammar already holds an object to the properties it names; this closes
    # one that names none, `{"type": "object"}`, to `{}`)
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        if self.whitespace_pattern:
            raise _structured(f"whitespace_pattern is {WHITESPACE_PATTERN_WHY}")
        given = [self.json is not None, self.json_object, self.tool_calls is not None]
        given += [self.regex is not None, self.choice is not None, self.grammar is not None]
        if sum(given) != 1:
            raise _structured(
                "give exactly one of json (a schema), json_object, regex, choice, grammar and tool_calls"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise _structured("choice needs a list of non-empty strings")
        if self.tool_calls is not None and not self.tool_calls:
            raise _structured("tool_calls needs at least one function")
        if not 1 <= self.max_tool_calls <= 16:
            raise _structured(f"max_tool_calls is 1 to 16, got {self.max_tool_calls}")
        if self.tool_call_form not in ("json", "xml", "kimi"):
            raise _structured(f"tool_call_form is 'json', 'xml' or 'kimi', got {self.tool_call_form!r}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise _structured(f"the JSON schema is not valid JSON ({e})") from None
            except RecursionError:  # nested past what the parser follows
                raise _too_deep_error() from None
            except ValueError:  # an integer past int()'s digits, whose error names a Python setting
                raise _structured("the JSON schema holds an integer of more than 4,300 digits") from None
        if any(v is not None and nests_deeper(v, MAX_SCHEMA_DEPTH) for v in (self.json, self.tool_calls)):
            raise _too_deep_error()
        # schema text's \uD800-\uDFFF escapes: the body's own check saw only their backslashes
        if self.json is not None and SURROGATE.search(json.dumps(self.json, ensure_ascii=False)):
            raise _structured(
                "the JSON schema holds a lone surrogate (an unpaired \\uD800-\\uDFFF escape), which is not Unicode"
            )
        if self.json is not None and not isinstance(self.json, dict):
            raise _structured("a JSON schema must be an object")
        if self.after_token is not None and self.after_token < 0:
            raise _structured(f"after_token must be a token id, got {self.after_token}")

    def _check_types(self) -> None:
        """What a JSON body can hold that the fields cannot (a number for a regex, a string for
        the choices): named, not read some other way."""
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _structured(f"{name} needs a non-empty string")
        for name in (
            "json_object",
            "optional_tool_calls",
            "disable_any_whitespace",
            "disable_fallback",
            "disable_additional_properties",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise _structured(f"{name} is true or false, got {type(value).__name__}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise _structured(
                f"whitespace_pattern needs a string, got {type(self.whitespace_pattern).__name__}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise _structured(
                f"json needs a JSON schema (an object or its text), got {type(self.json).__name__}"
            )

    def key(self) -> str:
        """The grammar's cache key (the schema's text: its key order is the output's)."""
        if self.tool_calls is not None:
            optional = "optional:" if self.optional_tool_calls else ""
            return f"tool_calls:{optional}{self.tool_call_form}:{self.max_tool_calls}:" + json.dumps(
                self.tool_calls
            )
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar:" + self.grammar
        compact = "compact:" if self.disable_any_whitespace else ""
        closed = "closed:" if self.disable_additional_properties else ""
        return compact + closed + ("json_object" if self.json_object else json.dumps(self.json))


class RequestOutputKind(Enum):
    """vLLM's names for `output_kind`'s values (`SamplingParams` reads a member as its name)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# vLLM's name for it (`from vllm.sampling_params import StructuredOutputsParams`), and its older one
StructuredOutputsParams = GuidedDecodingParams = StructuredOutputs


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's bad words as token sequences: each word as tokenized alone, and after a space where
    that starts with another token but is as long (the same word inside a sentence)."""
    if len(words) > MAX_BAD_WORDS:  # refused before thousands are tokenized
        raise InvalidParamError(f"bad_words holds at most {MAX_BAD_WORDS} words", "bad_words")
    out = []
    for word in words:
        if not word.strip():
            raise InvalidParamError("bad_words must not be empty or blank", "bad_words")
        alone = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        out.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return out


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's choice `index` (vLLM's `seed + index`), wrapped within 64 bits: a
    seed at the top of the range stays a valid seed for every choice."""
    return None if seed is None else (seed + index + 2**63) % 2**64 - 2**63


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token; 0 = only the chosen one
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> added to its logit before sampling (OpenAI's logit_bias: -100 bans a token, +100
    # all but forces it; the server clamps to [-100, 100], this takes any number, as vLLM's offline
    # API does); logprobs stay those of the unbiased logits
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (the others' logits -inf); logprobs as above
    allowed_token_ids: list[int] | None = None
    # vLLM's bad words as token sequences: a sequence's last token is never sampled right after
    # the others (a one-token sequence: never); the server tokenizes a request's `bad_words`
    bad_words_token_ids: list[list[int]] | None = None
    # "cumulative": an output every step while the request runs, each with everything so far;
    # "delta": an output every step that adds tokens, each with only what is new (streamed HTTP
    # requests: the cost of a step's outputs does not grow with their length);
    # "final_only": one output when it finishes (LLM.generate, non-streamed HTTP requests)
    output_kind: str = "cumulative"
    structured_outputs: StructuredOutputs | None = None
    # with scheduling_policy "priority": lower values are admitted first, and preempted last
    # (vLLM's request priority; under "fcfs" only 0 is accepted)
    priority: int = 0
    # False: outputs carry token ids and no text, the caller decodes them (the server does, in
    # its HTTP process, for streams without stop strings: the engine's step then skips it)
    detokenize: bool = True
    # vLLM's: these tokens' log-probabilities at each generated token (`Logprob.asked`), beside
    # the chosen token's and the top ones; without logprobs, logprobs is 0 (as vLLM reports them)
    logprob_token_ids: list[int] | None = None
    # vLLM's: these tokens' log-probabilities at each prompt position (`Logprob.asked` of
    # prompt_logprobs, which it needs); at most MAX_PROMPT_LOGPROB_TOKEN_IDS, no duplicates
    prompt_logprob_token_ids: list[int] | None = None
    # vLLM's bad words, as text: LLM.generate tokenizes them into bad_words_token_ids
    # (`bad_words_token_ids` below; the server does the same with a request's `bad_words`)
    bad_words: list[str] | None = None
    # vLLM's: LLM.generate keeps the prompt's last k tokens only (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = None
    # vLLM's; the fast tokenizers deltaserve loads put no spaces between special tokens either way
    spaces_between_special_tokens: bool = True
    # a request of the server's own (a health probe, a prefix warm-up): left out of the engine's
    # token counters and the prefix cache's hit rate, which count clients' requests
    internal: bool = False
    # a chat prompt: how many of its first tokens the conversation's next request repeats (its
    # messages, without the part of the generation prompt that the template does not render
    # again for the answer, such as Qwen3.5's `<think>\n`); the prefix cache keeps the prompt
    # end's state at the last page boundary within them. None: the whole prompt
    next_turn_len: int | None = None
    # a chat prompt: how many of its first tokens other conversations with the same system prompt
    # and tools send too (`chat_prompt.shared_head_tokens`); the prefix cache keeps the state at the last
    # page boundary within them, where the next such conversation leaves this one. None: no guess
    shared_prefix_len: int | None = None
    # vLLM's: the prefix cache serves this request only from entries cached by requests with the
    # same salt (None: the unsalted ones), so that tenants cannot time each other's prompts
    cache_salt: str | None = None
    # vLLM's older name for structured_outputs (before 0.11): read into it, then None
    guided_decoding: StructuredOutputs | dict[str, Any] | None = None
    # vLLM's: a delta request's later outputs carry at least this many tokens each (its first and
    # last go at once); the engine's own stream_interval is the floor. None: the engine's
    stream_interval: int | None = None
    # vLLM's: at most this many tokens inside the output's reasoning (`<think>` ... `</think>`),
    # then `</think>` is forced and the model answers; -1 or None: unlimited, 0: no reasoning
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        for name in _INTEGERS:  # before any comparison: 2.5 or True would pass it, "2" fail it oddly
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                hint = _BOOL_HINTS.get(name, "") if isinstance(value, bool) else ""
                raise InvalidParamError(f"{name} must be an integer, got {value!r}{hint}", name)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidParamError("cache_salt must be a non-empty string if provided", "cache_salt")
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if isinstance(self.output_kind, Enum):  # vLLM's RequestOutputKind.FINAL_ONLY and the like
            self.output_kind = self.output_kind.name.lower()
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidParamError(
                    "give structured_outputs or guided_decoding (its older name), not both", "guided_decoding"
                )
            # a dict is read into the dataclass just below, as structured_outputs' own is
            self.structured_outputs = cast(StructuredOutputs, self.guided_decoding)
            self.guided_decoding = None
        if isinstance(self.structured_outputs, dict):  # vLLM's fields as a dict: the dataclass
            known = {f.name for f in fields(StructuredOutputs)}
            unknown = sorted(set(self.structured_outputs) - known)
            if unknown:
                raise InvalidParamError(
                    f"structured_outputs has no field {unknown[0]!r}", "structured_outputs"
                )
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logprob_token_ids is not None and self.logprobs is None:
            self.logprobs = 0  # vLLM's: the asked ids are reported at generated tokens without logprobs
        if self.prompt_logprob_token_ids is not None and self.prompt_logprobs is None:
            raise InvalidParamError(
                "prompt_logprob_token_ids needs prompt_logprobs: they are where they are reported",
                "prompt_logprob_token_ids",
            )
        if self.top_k is not None and self.top_k < -1:
            raise InvalidParamError(f"top_k must be -1 (off) or positive, got {self.top_k}", "top_k")
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if isinstance(self.temperature, (int, float)) and floored(self.temperature) != self.temperature:
            logger.warning(
                "temperature %s is below %s, which may give inf or NaN: raised to %s, as vLLM does",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            self.temperature = floored(self.temperature)
        self.validate()

    def validate(self) -> None:
        """Raise InvalidParamError naming the field when a value is out of range or two disagree:
        the one check of a request's values, for the offline API and the HTTP server alike."""
        if self.output_kind not in OUTPUT_KINDS:
            raise InvalidParamError(
                f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}",
                "output_kind",
            )
        _in_range("n", self.n, 1, MAX_N)
        if (
            isinstance(self.priority, bool)
            or not isinstance(self.priority, int)
            or not -(2**63) <= self.priority < 2**63
        ):
            raise InvalidParamError(f"priority must be a 64-bit integer, got {self.priority!r}", "priority")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):  # the ranges below let inf through, some NaN
                raise InvalidParamError(f"{name} must be a finite number, got {getattr(self, name)}", name)
        _in_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _in_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _in_range("min_p", self.min_p, 0.0, 1.0)
        _in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.repetition_penalty <= 0:
            raise InvalidParamError(
                f"repetition_penalty must be positive, got {self.repetition_penalty}", "repetition_penalty"
            )
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidParamError(f"seed must be a 64-bit integer, got {self.seed}", "seed")
        if any(not s for s in self.stop):
            raise InvalidParamError("stop must not hold an empty string", "stop")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise InvalidParamError(
                f"stop holds at most {MAX_STOP} strings of at most {MAX_STOP_LENGTH} characters each", "stop"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParamError(
                f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids"
            )
        if (
            len(self.bad_words or []) > MAX_BAD_WORDS
            or len(self.bad_words_token_ids or []) > 2 * MAX_BAD_WORDS
        ):
            raise InvalidParamError(f"bad_words holds at most {MAX_BAD_WORDS} words", "bad_words")
        if self.stop and not self.detokenize:
            raise InvalidParamError("stop strings need the text: detokenize must be on", "detokenize")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words or []):
            raise InvalidParamError("bad_words must be non-blank strings", "bad_words")
        k = self.truncate_prompt_tokens
        if k is not None and k != -1 and k < 1:
            raise InvalidParamError(
                f"truncate_prompt_tokens must be -1 (the context length) or positive, got {k}",
                "truncate_prompt_tokens",
            )
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise InvalidParamError(f"stop_token_ids must be token ids, got {bad[0]!r}", "stop_token_ids")
        budget = self.thinking_token_budget
        if budget is not None and budget < -1:
            raise InvalidParamError(
                f"thinking_token_budget must be -1 (unlimited) or at least 0, got {budget}",
                "thinking_token_budget",
            )
        if self.stream_interval is not None and self.stream_interval < 1:
            raise InvalidParamError(
                f"stream_interval must be at least 1, got {self.stream_interval}", "stream_interval"
            )
        _in_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _in_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if len(self.logprob_token_ids or []) > MAX_LOGPROB_TOKEN_IDS:
            raise InvalidParamError(
                f"logprob_token_ids holds at most {MAX_LOGPROB_TOKEN_IDS} token ids", "logprob_token_ids"
            )
        prompt_ids = self.prompt_logprob_token_ids
        if prompt_ids is not None and not prompt_ids:
            raise InvalidParamError("prompt_logprob_token_ids must not be empty", "prompt_logprob_token_ids")
        if len(prompt_ids or []) > MAX_PROMPT_LOGPROB_TOKEN_IDS:
            raise InvalidParamError(
                f"prompt_logprob_token_ids holds at most {MAX_PROMPT_LOGPROB_TOKEN_IDS} token ids "
                "(each prompt position reports them)",
                "prompt_logprob_token_ids",
            )
        if len(set(prompt_ids or [])) != len(prompt_ids or []):
            raise InvalidParamError(
                "prompt_logprob_token_ids must not contain duplicates", "prompt_logprob_token_ids"
            )
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise InvalidParamError(
                f"max_tokens must be at least 1 (0 only with prompt_logprobs), got {self.max_tokens}",
                "max_tokens",
            )
        if self.min_tokens < 0:
            raise InvalidParamError(f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParamError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
            )
        allowed = self.allowed_token_ids
        if allowed is not None and (not allowed or any(type(t) is not int or t < 0 for t in allowed)):
            shown = allowed if len(allowed) <= 8 else [*allowed[:8], "..."]
            raise InvalidParamError(
                f"allowed_token_ids must be a non-empty list of token ids, got {shown!r}", "allowed_token_ids"
            )
        for seq in self.bad_words_token_ids or []:
            if not seq or any(type(t) is not int or t < 0 for t in seq):
                raise InvalidParamError(
                    f"bad_words_token_ids must be non-empty token id sequences, got {seq!r}"[:200],
                    "bad_words",
                )
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS:
            raise InvalidParamError(
                f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens (to sample from a few, give allowed_token_ids)",
                "logit_bias",
            )
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise InvalidParamError(f"logit_bias keys must be token ids, got {token!r}", "logit_bias")
            # vLLM's offline API adds any value as given (its server clamps to [-100, 100], as ours does)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise InvalidParamError(
                    f"logit_bias values must be numbers, got {bias!r} for token {token}", "logit_bias"
                )

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidParamError for a token id outside [0, vocab_size): a stop token id, logit_bias
        key, allowed token id or bad word's token."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("bad_words_token_ids", [t for seq in self.bad_words_token_ids or [] for t in seq]),
            ("logprob_token_ids", self.logprob_token_ids or []),
            ("prompt_logprob_token_ids", self.prompt_logprob_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidParamError(
                    f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", name
                )

    def clone(self) -> SamplingParams:
        """vLLM's: a deep copy, to change without changing this one."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


# the fields that take whole numbers only (a float or a bool there is a mistake, not a count)
_INTEGERS = (
    "n",
    "top_k",
    "seed",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "priority",
    "next_turn_len",
    "shared_prefix_len",
    "truncate_prompt_tokens",
    "stream_interval",
    "thinking_token_budget",
)


# a bool where a count of log-probabilities belongs: True read as 1, False as 0 would turn them
# on, so the refusal says which number to give (the chat API's `logprobs` is a bool)
_BOOL_HINTS = {
    name: f": the number of top log-probabilities per {where} besides the chosen token's (0: that one "
    f"alone; None, the default: none)"
    for name, where in (("logprobs", "generated token"), ("prompt_logprobs", "prompt token"))
}


def _in_range(name: str, value: float | None, low: float, high: float, low_open: bool = False) -> None:
    if value is None:
        return
    if not low <= value <= high or (low_open and value == low):  # NaN fails this too
        bracket = "(" if low_open else "["
        raise InvalidParamError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value}", name)
