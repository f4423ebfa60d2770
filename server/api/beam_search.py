"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the n best beams of each
prompt (`engine/requests/beam_search.py`), each step's beams sent to the engine as one-token
requests that ask for 2n log-probabilities, so that the prefix cache serves what the beams share.
A streamed search sends its beams as server-sent events once it ends: which beams win is known
only then."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deltaserve.engine.requests.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from deltaserve.engine.requests.outputs import CompletionOutput, RequestOutput
from deltaserve.engine.requests.sampling_params import SamplingParams

from ..edge import ARRIVED
from ..errors import bad_request
from ..protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaToolCall,
    PromptTokensDetails,
    Usage,
)
from .context import ClientDisconnected, ServerContext
from .generation import DONE
from .request_params import client_name, named_id

if TYPE_CHECKING:
    from deltaserve.engine.requests.beam_search import BeamSequence

    from .chat import PreparedChat

# what changes which tokens a sampler may pick, or asks for what a search does not give
_UNSCORED = (
    "stop", "stop_token_ids", "bad_words", "logit_bias", "allowed_token_ids", "min_tokens", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip


def beam_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> BeamSearchParams:
    """The request's search, or a 400 naming what a search cannot honour."""
    if req.logprob_token_ids is not None:  # vLLM's 400 too: a search's steps score no chosen ids
        raise bad_request("logprob_token_ids is not supported with use_beam_search", "logprob_token_ids")
    if (req.logprobs is not None if isinstance(req, CompletionRequest) else req.logprobs) or getattr(
        req, "top_logprobs", None
    ) is not None:
        raise bad_request("logprobs is not supported with use_beam_search", "logprobs")
    if req.return_token_ids:  # a beam's choice is built from its text
        raise bad_request("return_token_ids is not supported with use_beam_search", "return_token_ids")
    if req.prompt_logprobs is not None:  # the search's steps compute none to return
        raise bad_request("prompt_logprobs is not supported with use_beam_search", "prompt_logprobs")
    for name in _UNSCORED:
        if getattr(req, name, None):
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    if req.thinking_token_budget not in (None, -1):  # a forced token no beam's score would hold
        raise bad_request(
            "thinking_token_budget is not supported with use_beam_search", "thinking_token_budget"
        )
    try:
        return BeamSearchParams(
            beam_width=req.n,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=req.temperature or 0.0,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as exc:
        param = (
            "n" if "beam_width" in str(exc) else "temperature" if "temperature" in str(exc) else "max_tokens"
        )
        raise bad_request(str(exc).replace("beam_width", "n (the beam width)"), param) from exc


async def search(
    ctx: ServerContext,
    raw: Request,
    prompts: list[list[int]],
    params: BeamSearchParams,
    name: str | None = None,
    salt: str | None = None,
    priority: int = 0,
) -> tuple[list[BeamSearchOutput], int]:
    """Every prompt's best beams, and the prompt tokens the prefix cache served (the first step's:
    the prompts themselves); ClientDisconnected when the client hangs up between steps. `name`:
    the client's for the request, which its steps' engine ids start with (/abort_request)."""
    limit = ctx.client.max_model_len
    for ids in prompts:
        if len(ids) + params.max_tokens > limit:
            raise bad_request(
                f"the prompt's {len(ids)} tokens and max_tokens {params.max_tokens} exceed the context of {limit}",
                "max_tokens",
                code="context_length_exceeded",
            )
    held = ctx.client.max_requests
    if held is not None and params.beam_width > held:  # a step's beams run together on one engine
        raise bad_request(
            f"n: a beam search's {params.beam_width} beams run together on one engine, which holds at "
            f"most {held} requests (running and waiting)",
            "n",
        )
    beams = BeamSearch(prompts, params, ctx.client.eos_token_ids)
    # the first step is the prompts' own engine requests, counted as any prompt is (its tokens,
    # the cache's hits); the later ones repeat them with the beams' tokens and are left out of
    # the counters, which count the search once (`_count_search`)
    first_step = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        logprobs=2 * params.beam_width,
        ignore_eos=True,
        detokenize=False,
        cache_salt=salt,  # the request's steps hit only its salt's prefixes
        priority=priority,  # every step at the request's (a 400 under fcfs where not 0, as sampled)
    )
    later_steps = replace(first_step, internal=True)
    base = named_id(name, f"beam-{uuid.uuid4().hex}")
    engine: int | None = None  # one prompt's steps on its first step's engine, whose cache holds them
    cached = 0
    first: list[RequestOutput] = []  # each prompt's first step: the search's times and first token
    admitted = False
    started = raw.scope.get(ARRIVED, time.monotonic())  # an abort while the prompt was prepared counts
    searches = [f"{base}-prompt-{i}" for i in range(len(prompts))]  # the metrics' request ids
    for search_id in searches:
        ctx.metrics.request_started(search_id)
    try:
        while not beams.finished:
            if ctx.client.aborted_since(base, started):  # /abort_request between two steps
                beams.aborted = True
                break
            # a client gone between two steps: `collect`'s watcher may never have run in a step whose
            # outputs were in before it was read, so it is asked here
            if await raw.is_disconnected():
                raise ClientDisconnected
            step = later_steps if first else first_step
            requests = [
                (f"{base}-{beams.steps}-{i}", tokens, step) for i, tokens in enumerate(beams.expanding())
            ]
            # an abort since it arrived ends it
            group = await ctx.submit(requests, track=False, engine=engine, raw=raw, log=not first)
            admitted = True
            engine = group.engine if len(prompts) == 1 else None  # several prompts: each where it went
            final = await ctx.collect(group, raw)
            if not first:
                first = [final[r[0]] for r in requests]
                cached = sum(out.num_cached_tokens for out in first)
            steps = [final[r[0]].outputs[0] for r in requests]
            if any(s.finish_reason == "abort" for s in steps):  # /abort_request: the beams end as they are
                beams.aborted = True
                break
            beams.advance([s.logprobs[0].top for s in steps])  # type: ignore[index]
    except BaseException:
        for search_id in searches:  # as a request refused, or whose client went or that failed, is
            if admitted:
                ctx.metrics.request_aborted(search_id)
            else:
                ctx.metrics.forget(search_id)
        raise
    outputs = beams.outputs()
    _count_search(ctx, searches, prompts, outputs, first)
    return outputs, cached


def _count_search(
    ctx: ServerContext,
    searches: list[str],
    prompts: list[list[int]],
    outputs: list[BeamSearchOutput],
    first: list[RequestOutput],
) -> None:
    """Each prompt's search in the metrics as one finished request: its prompt, the beams it
    returns as its generated tokens, the best beam's finish reason, and the times of its first
    step (its queue, its first token) to now. The engine counted the first step's tokens."""
    now = time.monotonic()
    for i, (search_id, prompt, out) in enumerate(zip(searches, prompts, outputs)):
        step = first[i] if i < len(first) else None
        done = RequestOutput(
            search_id,
            prompt,
            [CompletionOutput(j, b.output_ids, "", b.finish_reason) for j, b in enumerate(out.sequences)],
            True,
            arrival_time=step.arrival_time if step is not None else 0.0,
            first_token_time=step.first_token_time if step is not None else None,
            scheduled_time=step.scheduled_time if step is not None else None,
        )
        counted = step.outputs[0].num_tokens if step is not None else 0
        ctx.metrics.tokens_generated(sum(c.num_tokens for c in done.outputs) - counted)
        ctx.metrics.request_progress(done, now)


def beam_text(ctx: ServerContext, beam: BeamSequence, params: BeamSearchParams, skip_special: bool) -> str:
    ids = beam.text_ids(params.include_stop_str_in_output)
    return ctx.need_tokenizer().decode(ids, skip_special_tokens=skip_special) if ctx.tokenizer else ""


def _usage(prompts: list[list[int]], outs: list[BeamSearchOutput], cached: int) -> Usage:
    prompt = sum(len(ids) for ids in prompts)
    completion = sum(len(b.output_ids) for out in outs for b in out.sequences)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(cached, prompt)),
    )


async def beam_search_completion(
    ctx: ServerContext, req: CompletionRequest, raw: Request, model: str, prompts: list[tuple[str, list[int]]]
) -> Response:
    params = beam_params(req, req.max_tokens)
    ids = [p for _, p in prompts]
    name = client_name(raw, req)
    try:
        outs, cached = await search(ctx, raw, ids, params, name, req.cache_salt, req.priority)
    except ClientDisconnected:
        return Response(status_code=499)
    choices: list[CompletionChoice] = []
    for (text, _), out in zip(prompts, outs):
        for beam in out.sequences:
            decoded = beam_text(ctx, beam, params, req.skip_special_tokens)
            choices.append(
                CompletionChoice(
                    index=len(choices),
                    text=(text if req.echo else "") + decoded,
                    finish_reason=beam.finish_reason,
                )
            )
    response = CompletionResponse(
        id=f"cmpl-{name or uuid.uuid4().hex}", model=model, choices=choices, usage=_usage(ids, outs, cached)
    )
    if req.stream:  # a chunk a beam, each whole and finished
        chunks = [response.model_copy(update={"choices": [c], "usage": None}) for c in choices]
        return _stream(req, chunks, response.model_copy(update={"choices": []}), {"prompt_logprobs"})
    payload = response.model_dump(mode="json")
    for choice in payload["choices"]:
        del choice["prompt_logprobs"]  # vLLM's field, for requests that ask for it
    return JSONResponse(payload)


async def beam_search_chat(
    ctx: ServerContext,
    req: ChatCompletionRequest,
    raw: Request,
    model: str,
    prepared: PreparedChat,
    params: BeamSearchParams,
) -> Response:
    """The chat's best beams as choices, each read for reasoning and tool calls as a sampled
    reply is (`ChatGeneration.final_choice`)."""
    from .chat import ChatGeneration

    name = client_name(raw, req)
    prompt_ids = prepared.prompt_ids
    try:
        (out,), cached = await search(ctx, raw, [prompt_ids], params, name, req.cache_salt, req.priority)
    except ClientDisconnected:
        return Response(status_code=499)
    reply = ChatGeneration(ctx, req, model, prepared)
    choices = []
    for i, beam in enumerate(out.sequences):
        text = beam_text(ctx, beam, params, req.skip_special_tokens)
        output = RequestOutput(
            name or "", prompt_ids, [CompletionOutput(0, beam.output_ids, text, beam.finish_reason)], True
        )
        choices.append(reply.final_choice(i, output))
    prompt_text = prepared.prompt if req.return_prompt_text else None
    response = ChatCompletionResponse(
        id=f"chatcmpl-{name or uuid.uuid4().hex}",
        model=model,
        choices=choices,
        usage=_usage([prompt_ids], [out], cached),
        prompt_text=prompt_text,
    )
    if req.stream:  # each beam's role, a chunk each as a sampled stream opens, then each whole message
        shell = ChatCompletionChunk(id=response.id, created=response.created, model=model, choices=[])
        opening = [
            ChatChunkChoice(index=c.index, delta=ChatDelta(role=c.message.role, content="")) for c in choices
        ]
        chunks = [shell.model_copy(update={"choices": [o], "prompt_text": prompt_text}) for o in opening]
        for c in choices:
            m = c.message
            calls = [DeltaToolCall(index=k, **call.model_dump()) for k, call in enumerate(m.tool_calls or [])]
            delta = ChatDelta(
                content=m.content,
                reasoning_content=m.reasoning_content,
                reasoning=m.reasoning,
                tool_calls=calls or None,
            )
            done = ChatChunkChoice(index=c.index, delta=delta, finish_reason=c.finish_reason)
            chunks.append(shell.model_copy(update={"choices": [done]}))
        return _stream(req, chunks, shell.model_copy(update={"usage": response.usage}), set())
    return JSONResponse(response.model_dump(mode="json", exclude={"prompt_logprobs"}))


def _stream(
    req: CompletionRequest | ChatCompletionRequest, chunks: list[Any], usage: Any, choice_exclude: set[str]
) -> StreamingResponse:
    """`chunks` as server-sent events, then the usage chunk where the client asks for it, then
    `[DONE]`, as a sampled request's stream ends."""
    exclude: dict[str, Any] = {"usage": True}
    if choice_exclude:
        exclude["choices"] = {"__all__": choice_exclude}
    events = [f"data: {chunk.model_dump_json(exclude=exclude)}\n\n" for chunk in chunks]
    if req.stream_options and req.stream_options.include_usage:
        events.append(f"data: {usage.model_dump_json()}\n\n")
    events.append(DONE)

    async def send() -> Any:
        for event in events:
            yield event

    return StreamingResponse(send(), media_type="text/event-stream")
