"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

OUTPUT_KINDS = ("cumulative", "delta", "final_only")


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
    regex: str | None = None  # the output matches this regular expression (whole)
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # the output is a sentence of this EBNF grammar (xgrammar's dialect)
    # the grammar starts after this token: the output's first tokens are free up to and including
    # it (the end of a reasoning section, `</think>`, when the prompt opened one); None: at once
    after_token: int | None = None

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.tool_calls is not None]
        given += [self.regex is not None, self.choice is not None, self.grammar is not None]
        if sum(given) != 1:
            raise ValueError(
                "structured outputs: give exactly one of json (a schema), json_object, regex, choice, "
                "grammar and tool_calls"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured outputs: choice needs a list of non-empty strings")
        if self.tool_calls is not None and not self.tool_calls:
            raise ValueError("structured outputs: tool_calls needs at least one function")
        if not 1 <= self.max_tool_calls <= 16:
            raise ValueError(f"structured outputs: max_tool_calls is 1 to 16, got {self.max_tool_calls}")
        if self.tool_call_form not in ("json", "xml", "kimi"):
            raise ValueError(
                f"structured outputs: tool_call_form is 'json', 'xml' or 'kimi', got {self.tool_call_form!r}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured outputs: the JSON schema is not valid JSON ({e})") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured outputs: a JSON schema must be an object")
        if self.after_token is not None and self.after_token < 0:
            raise ValueError(f"structured outputs: after_token must be a token id, got {self.after_token}")

    def key(self) -> str:
        """The grammar's cache key (the schema's text: its key order is the output's)."""
        if self.tool_calls is not None:
            return f"tool_calls:{self.tool_call_form}:{self.max_tool_calls}:" + json.dumps(self.tool_calls)
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar:" + self.grammar
        return "json_object" if self.json_object else json.dumps(self.json)


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
    # token id -> added to its logit before sampling (OpenAI's logit_bias, within [-100, 100]:
    # -100 bans a token, +100 all but forces it); logprobs stay those of the unbiased logits
    logit_bias: dict[int, float] | None = None
    # "cumulative": an output every step while the request runs, each with everything so far;
    # "delta": an output every step that adds tokens, each with only what is new (streamed HTTP
    # requests: the cost of a step's outputs does not grow with their length);
    # "final_only": one output when it finishes (LLM.generate, non-streamed HTTP requests)
    output_kind: str = "cumulative"
    structured_outputs: StructuredOutputs | None = None
    # False: outputs carry token ids and no text, the caller decodes them (the server does, in
    # its HTTP process, for streams without stop strings: the engine's step then skips it)
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field when a value is out of range."""
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need the text: detokenize must be on")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(
                f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}"
            )
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):  # the ranges below let inf through, some NaN
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids, got {bad[0]!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(
                f"max_tokens must be at least 1 (0 only with prompt_logprobs), got {self.max_tokens}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be within [0, 20], got {self.prompt_logprobs}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:  # NaN fails this too
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
