"""POST /v1/completions (the legacy text-completion endpoint)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, TypeAdapter

from ..errors import bad_request
from ..protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
)
from .context import ServerContext, text_chars
from .generation import Generation
from .json_body import Encoded, EncodedResponse, encode, encoded_list
from .logprobs import (
    TextOffsets,
    TokenText,
    completion_logprobs,
    prompt_completion_logprobs,
    vllm_prompt_logprobs,
)
from .request_params import structured_field, truncate_prompt

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import CompletionOutput, Logprob, RequestOutput

# vLLM's prompt_logprobs field, dumped as a choice dumps it
_PROMPT_LOGPROBS = TypeAdapter(list[dict[str, PromptLogprob] | None] | None)


def _prompts(
    ctx: ServerContext,
    prompt: str | list[str] | list[int] | list[list[int]],
    echo: bool,
    truncated: bool = False,
    add_special_tokens: bool = True,
) -> list[tuple[str, list[int]]]:
    """Every prompt as (text, token ids); token-id prompts are decoded only to be echoed. Prompts
    too long for the context are refused untokenized and undecoded, unless the request truncates them."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]  # type: ignore[list-item]
    for item in prompt:  # all before any is tokenized, checked or decoded
        if truncated:
            break
        if isinstance(item, str):
            ctx.refuse_overlong(item, "prompt")
        else:
            ctx.refuse_overlong_ids(item, "prompt")  # type: ignore[arg-type]
    out = []
    for item in prompt:
        if isinstance(item, str):
            out.append((item, ctx.encode(item, add_special_tokens=add_special_tokens)))
            continue
        bad = [t for t in item if not 0 <= t < ctx.vocab_size]  # type: ignore[union-attr]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", "prompt")
        ids = list(item)  # type: ignore[arg-type]
        out.append((ctx.decode(ids) if echo and ctx.tokenizer is not None else "", ids))
    for _, ids in out:  # this endpoint takes no images
        ctx.images.check_placeholders(ids, 0, "prompt")
    return out


def without_unasked(response: BaseModel) -> dict[str, Any]:
    """The response as JSON, vLLM's `prompt_logprobs` left out of choices that did not ask."""
    payload = response.model_dump(mode="json")
    for choice in payload["choices"]:
        if choice["prompt_logprobs"] is None:
            del choice["prompt_logprobs"]
    return payload


class _Choice:
    """One choice's text and logprobs, echo included, from the engine's output."""

    def __init__(
        self,
        prompt: tuple[str, list[int]],
        echo: bool,
        logprobs: int | None,
        token_text: TokenText,
        asked: bool = False,
    ) -> None:
        self.echo, self.logprobs = echo, logprobs
        self.asked = asked  # logprob_token_ids: its generated tokens' top logprobs are the asked ids'
        self.prompt_text, self.prompt_ids = prompt
        self.token_text = token_text
        # the echoed prompt's logprobs and the offsets past them, for the scored rows they came from
        self._echo: tuple[list[Logprob | None] | None, CompletionLogprobs, TextOffsets] | None = None

    def text(self, completion: CompletionOutput) -> str:
        return (self.prompt_text if self.echo else "") + completion.text

    def logprobs_of(
        self, out: RequestOutput, echo_prompt: bool = False, offsets: TextOffsets | None = None
    ) -> CompletionLogprobs | None:
        """The completion's logprobs (the prompt's before them with `echo_prompt`); `offsets`: the
        choice's text offsets so far (a stream's), by default from the text's start."""
        if self.logprobs is None:
            return None
        completion = out.outputs[0]
        offsets = offsets if offsets is not None else TextOffsets()
        echoed = self._echoed(out.prompt_logprobs, self.logprobs, offsets) if echo_prompt else None
        generated = completion_logprobs(
            completion.logprobs or [], self.logprobs, self.token_text, offsets, self.asked
        )
        if echoed is None:
            return generated
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(echoed, name).extend(getattr(generated, name))
        return echoed

    def _echoed(
        self, scored: list[Logprob | None] | None, top_k: int, offsets: TextOffsets
    ) -> CompletionLogprobs:
        """The echoed prompt's logprobs, `offsets` (at the text's start) then past them: built once
        for the prompt's n choices, which echo the same rows (this object is theirs), and copied."""
        if self._echo is None or self._echo[0] is not scored:
            built = prompt_completion_logprobs(self.prompt_ids, self.token_text, scored, top_k, offsets)
            self._echo = (scored, built, TextOffsets())
            self._echo[2].restore(offsets)
        else:
            offsets.restore(self._echo[2])
        built = self._echo[1]
        return CompletionLogprobs(
            tokens=list(built.tokens),
            token_logprobs=list(built.token_logprobs),
            top_logprobs=list(built.top_logprobs),
            text_offset=list(built.text_offset),
        )


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request) -> Response:
    ctx.force_usage(req)
    model = ctx.resolve_model(req.model)
    prompts = []
    truncating = req.truncate_prompt_tokens is not None
    texts = await ctx.off_loop(
        _prompts, ctx, req.prompt, req.echo, truncating, req.add_special_tokens, chars=text_chars(req.prompt)
    )
    for text, whole in texts:
        ids = truncate_prompt(req, whole, ctx.client.max_model_len)
        if len(ids) < len(whole) and req.echo:  # the echo is the prompt the model read
            text = await ctx.off_loop(ctx.decode, ids) if ctx.tokenizer is not None else ""
        prompts.append((text, ids))
    if req.use_beam_search:
        from .beam_search import beam_search_completion

        return await beam_search_completion(ctx, req, raw, model, prompts)
    generation = CompletionGeneration(ctx, req, model)
    bad_words = await ctx.bad_words_ids(req)
    for j, (text, ids) in enumerate(prompts):
        await asyncio.sleep(0)  # a batch's prompts one by one, other requests served between them
        # one request's values: the log warns of a low temperature once, not once a prompt
        params = ctx.sampling_params(req, len(ids), bad_words, warn=j == 0)
        if j == 0 and params.structured_outputs is not None:  # one grammar for every prompt
            await ctx.compile_structured(params.structured_outputs, structured_field(req), raw)
        generation.add(f"{generation.request_id}-{j}", ids, params)
        # the request's count (the echoed prompt's top ones): logprob_token_ids zeroes params'
        choice = _Choice(
            (text, ids), req.echo, req.logprobs, generation.token_text, bool(req.logprob_token_ids)
        )
        generation.choices += [choice] * req.n
    return await generation.respond(raw, req.stream)


class CompletionGeneration(Generation[CompletionChoice]):
    """A text completion's chunks and response: the text, echo and logprobs of each choice."""

    chunk_type = CompletionResponse
    id_prefix = "cmpl"

    def __init__(self, ctx: ServerContext, req: CompletionRequest, model: str) -> None:
        super().__init__(ctx, model, req)
        self.req: CompletionRequest = req
        self.choices: list[_Choice] = []  # by choice index
        self.offsets: dict[str, TextOffsets] = {}  # each stream's logprobs' text offsets so far
        # the encoded prompt_logprobs of each scored prompt, by its rows' id (n choices share them)
        self._prompt_logprobs: dict[int, tuple[list[Logprob | None], Encoded]] = {}

    def delta_event(self, out: RequestOutput) -> str | None:
        rid, completion = out.request_id, out.outputs[0]
        plain = (
            rid in self.offsets  # not the first: no echo, the text offset already set
            and self.choices[self.index[rid]].logprobs is None
            and completion.finish_reason is None
            and not self.usage_in_every_chunk
            and not self.req.return_token_ids
        )
        if not plain:
            return super().delta_event(out)
        if not completion.text:
            return None
        index = self.index[rid]
        return self.text_event(
            index,
            completion.text,
            lambda text: CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None),
        )

    def delta_choice(self, out: RequestOutput) -> CompletionChoice | None:
        rid, completion = out.request_id, out.outputs[0]
        choice = self.choices[self.index[rid]]
        first = rid not in self.offsets
        delta = choice.text(completion) if first else completion.text
        offsets = self.offsets.setdefault(rid, TextOffsets())
        logprobs = choice.logprobs_of(out, echo_prompt=choice.echo and first, offsets=offsets)
        ids = self.req.return_token_ids  # vLLM's: the prompt's in a choice's first chunk
        # vLLM's: a chunk whose text is held back still goes out to carry its tokens' ids or their count
        counted = bool(completion.token_ids) and (ids or self.usage_in_every_chunk)
        if not (
            delta or completion.finish_reason or (logprobs and logprobs.tokens) or (ids and first) or counted
        ):
            return None
        return CompletionChoice(
            index=self.index[rid],
            text=delta,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason if completion.finished() else None,
            prompt_token_ids=choice.prompt_ids if ids and first else None,
            token_ids=list(completion.token_ids) if ids else None,
        )

    def chunk_json(self, chunk: BaseModel, exclude: dict[str, Any] | None = None) -> str:
        # stream chunks never carry vLLM's prompt_logprobs (the whole response does, when asked)
        return super().chunk_json(chunk, {"choices": {"__all__": {"prompt_logprobs"}}, **(exclude or {})})

    async def response(self, final: dict[str, RequestOutput]) -> Response:
        """The whole response, encoded choice by choice with the event loop serving other requests
        between them; each prompt's `prompt_logprobs` are built and encoded once for its choices."""
        choices = []
        for rid, index in self.index.items():
            choices.append(encode(self.final_choice_json(index, final[rid])))
            await asyncio.sleep(0)
        payload = self.response_json([], final)
        payload["choices"] = encoded_list(choices)
        return EncodedResponse(encode(payload))

    def final_choice_json(self, index: int, out: RequestOutput) -> dict[str, Any]:
        """Choice `index` as JSON, its `prompt_logprobs` (when asked) spliced in encoded."""
        payload = self.final_choice(index, out).model_dump(mode="json")
        prompt_logprobs = None
        if self.req.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs_json(out.prompt_logprobs)
        if prompt_logprobs is None:
            del payload["prompt_logprobs"]
        else:
            payload["prompt_logprobs"] = prompt_logprobs
        return payload

    def prompt_logprobs_json(self, scored: list[Logprob | None] | None) -> Encoded | None:
        """vLLM's `prompt_logprobs` of the scored prompt, encoded once however many choices share it."""
        if scored is None:
            return None
        hit = self._prompt_logprobs.get(id(scored))
        if hit is None:
            rows = vllm_prompt_logprobs(scored, self.req.prompt_logprobs or 0, self.token_text)
            encoded = encode(_PROMPT_LOGPROBS.dump_python(rows, mode="json"))
            # the rows are kept with it, so that their id names no other rows meanwhile
            hit = self._prompt_logprobs[id(scored)] = (scored, encoded)
        return hit[1]

    def final_choice(self, index: int, out: RequestOutput) -> CompletionChoice:
        """Choice `index` of the whole response, without vLLM's `prompt_logprobs`
        (`final_choice_json` splices them in)."""
        choice = self.choices[index]
        return CompletionChoice(
            index=index,
            text=choice.text(out.outputs[0]),
            logprobs=choice.logprobs_of(out, echo_prompt=self.req.echo),
            finish_reason=out.outputs[0].finish_reason,
            stop_reason=out.outputs[0].stop_reason,
            prompt_token_ids=choice.prompt_ids if self.req.return_token_ids else None,
            token_ids=list(out.outputs[0].token_ids) if self.req.return_token_ids else None,
        )

    def response_json(self, choices: list[Any], final: dict[str, RequestOutput]) -> dict[str, Any]:
        usage = self.usage(list(final.values()))
        return without_unasked(
            CompletionResponse(id=self.response_id, model=self.model, choices=choices, usage=usage)
        )
