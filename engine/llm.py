"""The offline API, in vLLM's shape: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import numbers
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypedDict, cast

from deltaserve.engine.cache.adapter import (
    scores_once,
    scoring_params,
    unscored,
    warmup_params,
    warmup_prompts,
)
from deltaserve.engine.config import EngineConfig, SettingError
from deltaserve.engine.engine import Engine
from deltaserve.engine.errors import InvalidParamError
from deltaserve.engine.llm_arguments import as_given, engine_kwargs, no_adapter, special_tokens_option
from deltaserve.engine.requests.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from deltaserve.engine.requests.chat_prompt import (
    IMAGE_PARTS,
    check_parts,
    content_parts,
    image_urls,
    render_prompt,
    shared_head_tokens,
    tail_tokens,
    unrepeated_tail,
)
from deltaserve.engine.requests.generation_defaults import SamplingDefaults, load_sampling_defaults
from deltaserve.engine.requests.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from deltaserve.engine.requests.sampling_params import SamplingParams, bad_words_token_ids, choice_seed
from deltaserve.engine.step.admission import check_length
from deltaserve.models.vision.positions import ImageInputs
from deltaserve.models.vision.processor import load_image

logger = logging.getLogger(__name__)


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """vLLM's: a prompt's text (and its images, `{"image": [PIL images]}`); `cache_salt`: its
    prefix-cache hits come only from prompts with the same salt (`SamplingParams.cache_salt`)."""

    multi_modal_data: dict[str, Any]
    cache_salt: str


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_Tokens, total=False):
    """vLLM's: a prompt's token ids (and its images); `prompt`, its text, is what outputs report."""

    prompt: str
    multi_modal_data: dict[str, Any]
    cache_salt: str  # as TextPrompt's


PromptType = str | list[int] | TextPrompt | TokensPrompt | dict[str, Any]


def _legacy_token_prompts(texts: Any, ids: Sequence[int] | Sequence[Sequence[int]]) -> list[PromptType]:
    """Older vLLM's `generate(prompt_token_ids=...)` as TokensPrompts: a list of ints is one
    prompt, a list of lists one a prompt; `texts` (a str or one a prompt) ride along as their text."""
    if len(ids) == 0:
        raise ValueError("prompt_token_ids is empty: give at least one prompt")
    batch = list(ids) if hasattr(ids[0], "__len__") else [ids]  # lists, tuples or arrays of ids
    if texts is None:
        return [{"prompt_token_ids": list(cast(Sequence[int], p))} for p in batch]
    texts = [texts] if isinstance(texts, str) else list(texts)
    if len(texts) != len(batch) or not all(isinstance(t, str) for t in texts):
        raise ValueError("with prompt_token_ids, prompts are their texts: one str a prompt, the same number")
    return [{"prompt_token_ids": list(cast(Sequence[int], p)), "prompt": t} for p, t in zip(batch, texts)]


class LLM:
    def __init__(
        self,
        model: str,
        revision: str | None = None,
        download_dir: str | None = None,
        tokenizer_revision: str | None = None,
        **kwargs: Any,
    ) -> None:
        """`model`: a checkpoint folder or a Hugging Face repo id (fetched into the Hub's cache, at
        `revision` under `download_dir`, or found there offline); `tokenizer_revision`: as
        `--tokenizer-revision`, the revision of `tokenizer`'s repo, or without `tokenizer` of the
        model repo's tokenizer files; `kwargs`: `EngineConfig`'s fields,
        or vLLM's names for them (`gpu_memory_utilization`, `max_num_seqs`, `block_size`,
        `enforce_eager`, `enable_prefix_caching`, `kv_cache_dtype`, `kv_cache_memory_bytes`; `trust_remote_code`,
        `pipeline_parallel_size=1` and `distributed_executor_backend="mp"` change nothing; the
        others README lists), and `generation_config` as vLLM's: where default sampling values
        come from."""
        from deltaserve.models.checkpoints.hub import is_repo_id, resolve_checkpoint

        given_kwargs = kwargs
        kwargs, self._generation_config = engine_kwargs(kwargs)

        if kwargs.get("data_parallel_size", 1) != 1:
            raise ValueError(
                "data_parallel_size: the offline LLM is one engine; data parallelism is the server's "
                "(deltaserve serve --data-parallel-size N), or run one LLM per GPU"
            )
        dummy = kwargs.get("load_format") == "dummy"
        given = kwargs.get("tokenizer")
        if given is None and tokenizer_revision is not None and is_repo_id(model):
            given = model  # as --tokenizer-revision: the model repo's tokenizer files at that revision
        model = resolve_checkpoint(model, revision, download_dir, weights=not dummy)
        if given is not None:
            from deltaserve.models.checkpoints.loader import require_tokenizer

            kwargs["tokenizer"] = resolve_checkpoint(
                given, tokenizer_revision, download_dir, tokenizer_only=True
            )
            require_tokenizer(kwargs["tokenizer"], f"tokenizer {given!r}")
        try:
            config = EngineConfig(model=model, **kwargs)
        except SettingError as error:  # its message names our field, maybe not the name the user wrote
            raise as_given(error, given_kwargs) from None
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0
        self._defaults: SamplingDefaults | None = None  # generation_config.json, read once

    @property
    def llm_engine(self) -> Engine:
        """vLLM's name for the engine the LLM drives."""
        return self.engine

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks' processes (they also end with this process)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _encode(
        self, prompt: PromptType, add_special_tokens: bool = True
    ) -> tuple[list[int], str | None, ImageInputs | None]:
        """The prompt's ids and text, and its images (vLLM's `multi_modal_data={"image": ...}`,
        PIL images) with their tokens expanded in the ids."""
        ids, text = self._prompt_ids(prompt, add_special_tokens)
        media = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not media:
            return ids, text, None
        if set(media) - {"image"}:
            raise ValueError(f"multi_modal_data takes images only, not {sorted(set(media) - {'image'})}")
        images = list(media["image"]) if isinstance(media["image"], (list, tuple)) else [media["image"]]
        inputs = self.engine.process_images(images)
        return self.engine.expand_image_tokens(ids, inputs), text, inputs

    def _prompt_ids(
        self, prompt: PromptType, add_special_tokens: bool = True
    ) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            prompt = cast(dict[str, Any], prompt)  # a TextPrompt, a TokensPrompt or a plain dict
            if "prompt_token_ids" in prompt:
                return _token_ids(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" not in prompt:
                raise ValueError(
                    f"a prompt dict holds 'prompt' or 'prompt_token_ids', not only {sorted(prompt)}"
                )
            return self._prompt_ids(prompt["prompt"], add_special_tokens)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass {'prompt_token_ids': [...]} instead")
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)), prompt
        return _token_ids(prompt), None

    def _tokenized_bad_words(self, params: SamplingParams) -> SamplingParams:
        """vLLM's `bad_words` (text) as the token sequences the sampler bans (`bad_words_token_ids`)."""
        if not params.bad_words:
            return params
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise InvalidParamError("bad_words need a tokenizer, and this checkpoint has none", "bad_words")
        ids = bad_words_token_ids(params.bad_words, lambda w: tokenizer.encode(w, add_special_tokens=False))
        return dataclasses.replace(
            params, bad_words=None, bad_words_token_ids=[*(params.bad_words_token_ids or []), *ids]
        )

    def _truncated(
        self, encoded: tuple[list[int], str | None, ImageInputs | None], k: int | None
    ) -> tuple[list[int], str | None, ImageInputs | None]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: the context's length)."""
        ids, text, images = encoded
        if k is None:
            return encoded
        if images is not None:
            raise InvalidParamError(
                "truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens"
            )
        limit = self.engine.max_model_len
        if k > limit:
            raise InvalidParamError(
                f"truncate_prompt_tokens ({k}) exceeds this model's maximum context length ({limit})",
                "truncate_prompt_tokens",
            )
        k = limit if k == -1 else k
        return ids[-k:], text, images

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling values (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens; another folder's, or none, as the LLM's
        `generation_config` says), else SamplingParams' defaults; what `generate` uses when given
        no sampling parameters, as vLLM's LLM does."""
        if self._defaults is None:
            self._defaults = load_sampling_defaults(self._generation_config, self.engine.config.model)
            warning = self._defaults.warning()
            if warning:
                logger.warning("%s", warning)
        return self._defaults.sampling_params()

    def _warm_prefixes(
        self,
        prompts: list[tuple[list[int], ImageInputs | None, str | None]],
        scoring: Sequence[tuple[list[int], SamplingParams, ImageInputs | None]] = (),
    ) -> list[list[Any] | None]:
        """Prompts sampled n > 1 times, with their images and cache salts: prefill each once
        first (`warmup_prompts`). `scoring`: prompts whose copies share prompt logprobs
        (`scores_once`), each computed here once, in its order, by a prefill that warms the
        cache as well."""
        config = self.engine.config
        scored = {(tuple(ids), params.cache_salt) for ids, params, _ in scoring}
        # a warm-up without its prompt's images would cache a text the copies never match
        imaged = {tuple(ids[:-1]): (ids[-1], images) for ids, images, _ in prompts if images is not None}
        image_token = self.engine.admission.images.image_token_id
        for salt in dict.fromkeys(s for _, _, s in prompts):  # each salt's copies hit only its own
            mine = [p for p, _, s in prompts if s == salt and (tuple(p), salt) not in scored]
            for ids in warmup_prompts(mine, config.cache_type, config.page_size):
                last, images = imaged.get(tuple(ids), (None, None))
                if (
                    images is not None and last == image_token
                ):  # the prompt less its last token splits an image
                    continue
                params = dataclasses.replace(warmup_params(), cache_salt=salt)
                self.engine.add_request(f"llm-warm-{self._next_id}", ids, params, images)
                self._next_id += 1
        scoring_ids = []
        for ids, params, images in scoring:
            scoring_ids.append(f"llm-warm-{self._next_id}")
            self.engine.add_request(scoring_ids[-1], ids, scoring_params(params), images)
            self._next_id += 1
        final = {out.request_id: out for outputs in self._steps() for out in outputs if out.finished}
        return [final[rid].prompt_logprobs for rid in scoring_ids]

    def _steps(self) -> Iterator[list[RequestOutput]]:
        """The engine's steps until no request is left. A step that raises leaves no request's
        state to trust: every request still in the engine is aborted before the error goes on,
        so the next call starts clean (as the server's engine loop does)."""
        while self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step()
            except BaseException:
                for request_id in list(self.engine.requests):
                    self.engine.abort_request(request_id)
                if self.engine.has_unfinished_requests() and self.engine.dead_reason is None:
                    try:  # a step in flight (overlap) is read back and dropped
                        self.engine.step()
                    except Exception:
                        logger.exception("clean-up step after a failed step failed too")
                raise
            yield outputs

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
        *,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        prompt_adapter_request: Any = None,
        guided_options_request: Any = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts; `n > 1` gives n completions per prompt.
        `use_tqdm`: a progress bar (from 16 requests), or vLLM's callable making one.
        `priority`: one a prompt, with `scheduling_policy="priority"` (lower values run first).
        `prompt_token_ids`: older vLLM's keyword, one prompt's ids or a list of them; with `prompts`
        (one text a prompt) the ids run and the texts are what the outputs report.
        vLLM's `lora_request`, `prompt_adapter_request` and `guided_options_request` are taken as
        None; `tokenization_kwargs` as `{"add_special_tokens": bool}` for text prompts."""
        no_adapter(lora_request, prompt_adapter_request)
        if guided_options_request is not None:
            raise ValueError(
                "guided_options_request: give SamplingParams(structured_outputs=StructuredOutputsParams(...))"
            )
        add_special_tokens = special_tokens_option(tokenization_kwargs, True)
        if prompt_token_ids is not None:
            prompts = _legacy_token_prompts(prompts, prompt_token_ids)
        elif prompts is None:
            raise ValueError("give prompts (or prompt_token_ids)")
        batch: list[PromptType]
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(batch)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(batch):
            raise ValueError("give one SamplingParams, or one per prompt")
        for params in params_list:
            if params.n > 1 and params.temperature == 0:
                # vLLM's: greedy choices are copies of one reply (the server's 400 says the same)
                raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got {params.n}")
        if priority is not None:
            if len(priority) != len(batch):
                raise ValueError("give one priority per prompt")
            params_list = [dataclasses.replace(p, priority=v) for p, v in zip(params_list, priority)]
        params_list = [self._tokenized_bad_words(p) for p in params_list]
        params_list = [  # vLLM's prompt dicts carry it, its SamplingParams do not
            dataclasses.replace(params, cache_salt=p["cache_salt"])
            if isinstance(p, dict) and p.get("cache_salt") is not None
            else params
            for p, params in zip(batch, params_list)
        ]
        encoded = [  # all validated before any is queued
            self._truncated(self._encode(p, add_special_tokens), params.truncate_prompt_tokens)
            for p, params in zip(batch, params_list)
        ]
        for (ids, _, _), params in zip(encoded, params_list):  # before a warm-up prefill runs
            check_length(len(ids), params.max_tokens, self.engine.max_model_len)
        shared = [scores_once(params, params.n) for params in params_list]
        scores = iter(
            self._warm_prefixes(
                [
                    (ids, images, params.cache_salt)
                    for (ids, _, images), params in zip(encoded, params_list)
                    if params.n > 1
                ],
                [
                    (ids, params, images)
                    for (ids, _, images), params, s in zip(encoded, params_list, shared)
                    if s
                ],
            )
        )
        given: dict[str, list[Any] | None] = {}  # prompt logprobs of the prompts that share them
        groups: list[tuple[str, list[str], list[int], str | None]] = []
        added: list[str] = []
        try:
            for (ids, text, images), params in zip(encoded, params_list):
                base = f"llm-{self._next_id}"
                self._next_id += 1
                subs = []
                if shared[len(groups)]:
                    given[base] = next(scores)
                for i in range(params.n):
                    sub = copy.deepcopy(unscored(params) if base in given else params)
                    sub.n = 1
                    sub.output_kind = "final_only"  # generate() returns finished outputs only
                    sub.seed = choice_seed(params.seed, i)
                    rid = f"{base}-{i}"
                    self.engine.add_request(rid, ids, sub, images)
                    added.append(rid)
                    subs.append(rid)
                groups.append((base, subs, ids, text))
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            self.engine.step()
            raise
        final: dict[str, RequestOutput] = {}
        finished_at: dict[str, float] = {}
        bar = _progress(len(added), use_tqdm) if use_tqdm and len(added) >= 16 else None
        for outputs in self._steps():
            now = time.time()
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
                    finished_at[out.request_id] = now
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        results = []
        for (base, subs, ids, text), params in zip(groups, params_list):
            decode = self._token_decoder() if params.detokenize else None
            comps: list[CompletionOutput] = []
            cached = 0
            for i, rid in enumerate(subs):
                out = final[rid]
                comp = out.outputs[0]
                comp.index = i
                if comp.logprobs is not None:  # vLLM's shape: a dict a position
                    comp.logprobs = [PositionLogprobs(lp, decode) for lp in comp.logprobs]
                if params.logprobs is None:  # vLLM's: no sum of log-probabilities not asked for
                    comp.cumulative_logprob = None
                comps.append(comp)
                cached = max(cached, out.num_cached_tokens)
            prompt_logprobs = given[base] if base in given else final[subs[0]].prompt_logprobs
            if prompt_logprobs is not None:
                prompt_logprobs = [
                    None if lp is None else PositionLogprobs(lp, decode) for lp in prompt_logprobs
                ]
            arrival = final[subs[0]].arrival_time
            first_token = _earliest(final[rid].first_token_time for rid in subs)
            scheduled = _earliest(final[rid].scheduled_time for rid in subs)
            finished = max(finished_at[rid] for rid in subs)
            results.append(
                RequestOutput(
                    base,
                    ids,
                    comps,
                    True,
                    prompt=text,
                    num_cached_tokens=cached,
                    arrival_time=arrival,
                    first_token_time=first_token,
                    scheduled_time=scheduled,
                    num_draft_tokens=sum(final[rid].num_draft_tokens for rid in subs),
                    num_accepted_tokens=sum(final[rid].num_accepted_tokens for rid in subs),
                    prompt_logprobs=prompt_logprobs,
                    metrics=RequestMetrics(
                        arrival_time=arrival,
                        last_token_time=finished if first_token is not None else None,
                        first_scheduled_time=scheduled,
                        first_token_time=first_token,
                        time_in_queue=None if scheduled is None else scheduled - arrival,
                        finished_time=finished,
                    ),
                )
            )
        return results

    def _token_decoder(self) -> Callable[[int], str] | None:
        """A token id's text, as vLLM's logprobs give it (`decoded_token`): the token decoded alone."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        return functools.lru_cache(maxsize=None)(lambda token_id: tokenizer.decode([token_id]))

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of OpenAI-shaped message dicts) or several,
        rendered with the checkpoint's chat template (or `chat_template`), then `generate`d; the
        outputs' `prompt` is the rendered text. A ValueError for what the template cannot render.
        Each prompt tells the prefix cache what the conversation's next turn repeats of it, so
        that the next turn starts from the state there (as the server's chat endpoint does).
        The arguments are vLLM's, in its order: `lora_request` None, `mm_processor_kwargs` None or
        empty, `tokenization_kwargs` as `generate`'s (no special tokens added by default)."""
        no_adapter(lora_request)
        if mm_processor_kwargs:
            raise ValueError(
                f"mm_processor_kwargs {sorted(mm_processor_kwargs)}: images are processed as the "
                "checkpoint's preprocessor config says, with no overrides"
            )
        add_special_tokens = special_tokens_option(tokenization_kwargs, False)
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer to render a chat with")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(
                f"chat_template_content_format {chat_template_content_format!r}: a message's text parts "
                "reach the template joined as one string (images as their own parts), vLLM's 'auto' "
                "and 'string' for these models"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        for conversation in conversations:
            for index, message in enumerate(cast(list[dict[str, Any]], conversation)):
                check_parts(message, index)  # audio or a file: refused by name, as the server's chat does
        if self.engine.image_processor is None and any(map(_has_images, conversations)):
            # refused before rendering: a text template fails on image parts with its own error
            raise InvalidParamError(
                f"the prompt has images, but {self.engine.admission.images.refusal}", "messages"
            )
        texts = [
            render_prompt(
                self.tokenizer,
                list(conversation),  # type: ignore[arg-type]
                template=chat_template,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        # the template writes the special tokens itself: none are added again, unless asked for
        prompts: list[dict[str, Any]] = [
            {
                "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=add_special_tokens),
                "prompt": text,
            }
            for text in texts
        ]
        for prompt, conversation in zip(prompts, conversations):
            urls = image_urls(conversation)  # type: ignore[arg-type]
            if urls:
                prompt["multi_modal_data"] = {"image": [load_image(url) for url in urls]}
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if add_generation_prompt and not continue_final_message and not add_special_tokens:
            sampling_params = self._next_turn_hints(
                prompts, conversations, sampling_params, chat_template, tools, chat_template_kwargs
            )
        return self.generate(prompts, sampling_params, use_tqdm)

    def _next_turn_hints(
        self,
        prompts: list[dict[str, Any]],
        conversations: Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        template: str | None,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> SamplingParams | Sequence[SamplingParams]:
        """Each prompt's params with `next_turn_len` where the next turn stops repeating it before
        its end (`unrepeated_tail`: Qwen3.5's `<think>\n`), and `shared_prefix_len` where other
        conversations with its system prompt and tools leave it (`shared_head_tokens`); a text-only
        prompt's, as the server."""
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            return sampling_params  # generate names the mismatch
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        for i, (prompt, conversation) in enumerate(zip(prompts, conversations)):
            if "multi_modal_data" in prompt or params[i].truncate_prompt_tokens is not None:
                continue  # its ids grow by the images' tokens, or lose their head
            text, ids = prompt["prompt"], prompt["prompt_token_ids"]
            start = unrepeated_tail(
                self.tokenizer,
                list(conversation),
                text,
                template=template,
                tools=tools,
                template_kwargs=template_kwargs,
            )
            tail = tail_tokens(ids, text, start, encode)
            if 0 < tail < len(ids):
                params[i] = dataclasses.replace(params[i], next_turn_len=len(ids) - tail)
            shared = shared_head_tokens(
                self.tokenizer, list(conversation), ids, encode, template=template, tools=tools,
                template_kwargs=template_kwargs,
            )  # fmt: skip
            if 0 < shared < len(ids):
                params[i] = dataclasses.replace(params[i], shared_prefix_len=shared)
        return params

    def get_tokenizer(self, lora_request: Any = None) -> Any:
        """The checkpoint's tokenizer (None for a checkpoint without one), or the one `set_tokenizer`
        gave; vLLM's `lora_request` is taken as None (an adapter's tokenizer: ValueError)."""
        no_adapter(lora_request)
        return self.tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """vLLM's: encode prompts, render chats and decode outputs with `tokenizer` (a transformers
        tokenizer) from now on; the model's stop token ids stay the checkpoint's."""
        self.engine.set_tokenizer(tokenizer)
        self.tokenizer = tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV page and state snapshot (vLLM's): later prompts are computed anew."""
        self.engine.flush_cache()
        return True

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (`engine/requests/beam_search.py`): a prompt's best `beam_width`
        beams, best first, each with its tokens, text (vLLM's: the prompt and output decoded
        together), cumulative log-probability and the candidates of every step. vLLM's `lora_request` is taken as None; `use_tqdm` draws a bar
        over the token steps (off, with a warning, where `concurrency_limit` is given, as vLLM's);
        `concurrency_limit=N`, as vLLM's, searches the prompts N at a time (each N to its end
        before the next: at most N x beam_width requests a step), finding the beams a search of
        all at once finds. A prompt dict's `cache_salt` holds for every step of its search."""
        no_adapter(lora_request)
        prompt_ids = [self._prompt_ids(p)[0] for p in prompts]
        salts = [cast(dict[str, Any], p).get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        if concurrency_limit is None:
            limit = max(len(prompt_ids), 1)
        elif isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, numbers.Integral):
            raise ValueError(f"concurrency_limit must be an integer or None, got {concurrency_limit!r}")
        elif concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be at least 1, got {concurrency_limit}")
        else:
            limit = int(concurrency_limit)
        if use_tqdm and concurrency_limit is not None:
            logger.warning("beam_search draws no progress bar with concurrency_limit, as vLLM's")
            use_tqdm = False
        results: list[BeamSearchOutput] = []
        counted = 0  # tokens generated that the engine counted: the first steps'
        for start in range(0, len(prompt_ids), limit):
            found, first_tokens = self._beam_search(
                prompt_ids[start : start + limit], params, salts[start : start + limit], use_tqdm
            )
            results += found
            counted += first_tokens
        returned = sum(len(beam.output_ids) for out in results for beam in out.sequences)
        self.engine.count_generated(returned - counted)  # the search's tokens, as the server's /metrics
        for out in results:
            for beam in out.sequences:  # vLLM's: the prompt and every token, as the tokenizer decodes them
                beam.text = self.tokenizer.decode(beam.tokens) if self.tokenizer else ""
        return results

    def _beam_search(
        self,
        prompts: list[list[int]],
        params: BeamSearchParams,
        salts: list[str | None],
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> tuple[list[BeamSearchOutput], int]:
        """`prompts`' searches run together to their end, each under its `cache_salt`, and the
        tokens of their first step (the only step the engine counts); `use_tqdm` draws a bar over
        the steps, up to max_tokens."""
        search = BeamSearch(prompts, params, self.engine.eos_token_ids)
        # the engine counts the first step as it counts any prompt (its tokens, the cache's hits);
        # the later ones repeat the prompts with the beams' tokens, so they run uncounted
        first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
        later = dataclasses.replace(first, internal=True)
        counted = 0
        # max_tokens is the bound, as vLLM's bar: a search whose beams all end early stops short of it
        bar = _progress(params.max_tokens, use_tqdm, "Beam search", "token") if use_tqdm else None
        try:
            while not search.finished:
                step = later if search.steps else first
                beam_salts = [
                    salt for salt, beams in zip(salts, search.live) for _ in beams
                ]  # as expanding()
                batch: list[PromptType] = [
                    {"prompt_token_ids": t} if salt is None else {"prompt_token_ids": t, "cache_salt": salt}
                    for t, salt in zip(search.expanding(), beam_salts)
                ]
                outs = self.generate(batch, step, use_tqdm=False)
                if step is first:
                    counted = sum(o.outputs[0].num_tokens for o in outs)
                search.advance([o.outputs[0].logprobs[0].top for o in outs])  # type: ignore[index]
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return search.outputs(), counted

    def update_weights_from_disk(
        self, model_path: str, load_format: str = "auto", weight_version: str | None = None
    ) -> None:
        """Generate with the weights of another checkpoint of the same model from now on (as
        SGLang's Engine does): loaded in host memory, checked, then copied over the served ones;
        the prefix cache is dropped. ValueError, with nothing changed, for another model's."""
        self.engine.update_weights_from_disk(model_path, load_format, weight_version)


def _token_ids(values: Iterable[Any]) -> list[int]:
    """A prompt's token ids as ints; a float, string or bool is refused, not rounded or parsed."""
    out = []
    for value in values:
        try:
            if isinstance(value, bool):
                raise TypeError
            out.append(operator.index(value))  # ints, numpy's and 0-d integer tensors
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {value!r}") from None
    return out


def _has_images(conversation: Any) -> bool:
    """Whether a conversation's messages hold image parts (OpenAI's `image_url`, or `image`)."""
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PARTS
        for message in conversation
        for part in content_parts(message)
    )


def _earliest(times: Iterable[float | None]) -> float | None:
    """The first of a prompt's samples' times (None where none has it)."""
    return min((t for t in times if t is not None), default=None)


def _progress(
    total: int, make: bool | Callable[..., Any] = True, desc: str = "generate", unit: str = "req"
) -> Any:
    """A progress bar over `total` units: tqdm's, or the one vLLM's callable `use_tqdm` makes."""
    if callable(make):
        return make(total=total, desc=desc, unit=unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit)
