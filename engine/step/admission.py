"""A new request checked against the model and the engine's limits, and built: its detokenizer,
seed generator and grammar matcher. Nothing is left behind when a check fails."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.errors import InvalidParamError, QueueFullError
from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
from deltaserve.engine.requests.request import Request
from deltaserve.engine.requests.sampling_params import SamplingParams, StructuredOutputs
from deltaserve.engine.sampling.sampler import Sampler
from deltaserve.engine.sampling.thinking_budget import (
    ThinkingBudget,
    prompt_opens_reasoning,
    reasoning_token_ids,
)
from deltaserve.models.vision.positions import ImageInputs, ImagePrompt, image_prompt


def check_length(n_prompt: int, max_tokens: int | None, max_len: int) -> None:
    """ValueError where a prompt of `n_prompt` tokens and its `max_tokens` (None: the rest of the
    context) do not fit the maximum model length."""
    if max_tokens is None:
        if n_prompt >= max_len:
            raise ValueError(f"the prompt has {n_prompt} tokens; the maximum model length is {max_len}")
    elif n_prompt + max_tokens > max_len:
        raise ValueError(
            f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: together "
            f"{n_prompt + max_tokens}, over the maximum model length of {max_len}"
        )


class LazyGrammars:
    """Structured outputs' compiled grammars (`engine/sampling/structured.py`), built at first
    use: building them reads the whole vocabulary, and most servers never need them."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.grammars: Any = None
        self._lock = threading.Lock()  # the server builds them in a thread while the engine steps

    def reset(self, tokenizer: Any) -> None:
        """Build from `tokenizer` at next use: the vocabulary tables and compiled grammars are its."""
        with self._lock:
            self.tokenizer = tokenizer
            self.grammars = None

    def get(self) -> Any:
        with self._lock:
            if self.grammars is None:
                from deltaserve.engine.sampling.structured import Grammars

                self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self.grammars


@dataclass(frozen=True)
class ImageInput:
    """How the engine takes a prompt's images: its image token and the tower's merge, or why not."""

    image_token_id: int | None = None
    merge: int = 2
    refusal: str | None = None


class Admission:
    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        max_model_len: int,
        tokenizer: Any,
        sampler: Sampler,
        grammars: LazyGrammars,
        images: ImageInput = ImageInput(refusal="the model reads text only"),
    ) -> None:
        self.images = images
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.grammars = grammars
        self._reasoning: tuple[int, int] | None = None
        self._reasoning_ids_of: Any = None  # the tokenizer `_reasoning` was read from

    def build(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        running: int,
        waiting: int,
        images: ImageInputs | None = None,
    ) -> Request:
        """The request, or a ValueError (bad input) / QueueFullError (`waiting` requests wait
        already, beside `running` ones). `images`: the prompt's, whose tokens it already holds
        (`models.vision.positions.expand_image_tokens`)."""
        vocab, max_len = self.vocab_size, self.max_model_len
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        params = copy.copy(params)  # max_tokens may be filled in below; the caller's stays as given
        params.validate()
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidParamError(
                f"priority {params.priority} needs priority scheduling, which this engine does not run "
                "(--scheduling-policy priority; offline, LLM(..., scheduling_policy='priority'))",
                "priority",
            )
        params.check_vocab(vocab)
        if params.stop and self.tokenizer is None:  # no text to find them in: they would never match
            raise InvalidParamError(
                "stop strings need the text, and this model has no tokenizer: give stop_token_ids", "stop"
            )
        n_prompt = len(prompt_token_ids)
        check_length(n_prompt, params.max_tokens, max_len)
        if params.max_tokens is None:
            params.max_tokens = max_len - n_prompt
        # requests not yet scheduled into free running places do not count against the bound
        free = max(0, self.config.num_running - running)
        if waiting >= self.config.max_waiting_requests + free:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting_requests} requests beyond the running batch)"
            )
        image_prompt = self._image_prompt(prompt_token_ids, images) if images is not None else None
        matcher = None
        if params.structured_outputs is not None:  # compiled here: a bad schema is the caller's 400
            matcher = self.grammars.get().matcher(params.structured_outputs)
        thinking = self._thinking_budget(prompt_token_ids, params.thinking_token_budget)
        return Request(
            images=image_prompt,
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            # a final-only output without stop strings needs its text once, at the end
            detokenizer=IncrementalDetokenizer(
                self.tokenizer if params.detokenize else None,
                params.skip_special_tokens,
                deferred=params.output_kind == "final_only" and not params.stop,
            ),
            generator=self.sampler.new_generator(params.seed),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            matcher=matcher,
            thinking=thinking,
        )

    def _thinking_budget(self, prompt: list[int], budget: int | None) -> ThinkingBudget | None:
        """The request's reasoning budget state; None without a budget (-1 or None: unlimited)."""
        if budget is None or budget == -1:
            return None
        ids = self._reasoning_ids()
        if ids is None:
            raise InvalidParamError(
                "thinking_token_budget needs a model whose tokenizer has <think> and </think>, and this one's does not",
                "thinking_token_budget",
            )
        start, end = ids
        return ThinkingBudget(budget, start, end, prompt_opens_reasoning(prompt, start, end))

    def _reasoning_ids(self) -> tuple[int, int] | None:
        # looked up once per tokenizer: its vocabulary is a large dict to build
        if self._reasoning_ids_of is not self.tokenizer:
            self._reasoning = reasoning_token_ids(self.tokenizer)
            self._reasoning_ids_of = self.tokenizer
        return self._reasoning

    def _image_prompt(self, prompt: list[int], images: ImageInputs) -> ImagePrompt:
        if self.images.refusal is not None:
            raise InvalidParamError(f"the prompt has images, but {self.images.refusal}", "messages")
        assert self.images.image_token_id is not None
        return image_prompt(prompt, images, self.images.image_token_id, self.images.merge)

    def compile_structured(self, spec: StructuredOutputs) -> Future[Any] | None:
        """Compile `spec`'s grammar into the cache now (ValueError for a bad schema or a missing
        xgrammar), so that admitting the request does not compile it on the engine's thread; a
        grammar another call is compiling: that compile's Future, not waited for here."""
        compiled = self.grammars.get().compile(spec, wait=False)
        return compiled if isinstance(compiled, Future) else None
