"""POST /v1/chat/completions."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .chat_output import ChatOutputParser, ChatStreamState, to_openai_tool_calls
from .chat_template import render_chat
from .context import ClientDisconnected, ServerContext
from .engine_client import RequestGroup
from .errors import error_body, failure_of, raise_if_failed
from .logprobs import chat_logprobs, vllm_prompt_logprobs
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    PromptTokensDetails,
    StreamOptions,
    Usage,
    random_id,
)
from .reasoning import prompt_opens_reasoning
from .request_params import build_sampling_params, fan_out, tool_choice_constraint
from .tool_calls import KIMI

if TYPE_CHECKING:
    from deltaserve.engine.outputs import RequestOutput
    from deltaserve.engine.sampling_params import SamplingParams


def finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def usage_of(prompt_tokens: int, outputs: list[RequestOutput]) -> Usage:
    completion = sum(c.num_tokens for out in outputs for c in out.outputs)
    cached = min(prompt_tokens, max((out.num_cached_tokens for out in outputs), default=0))
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


@dataclass
class PreparedChat:
    """A chat request made ready for the engine: its prompt, sampling parameters (with any
    grammar for JSON output or a forced tool call) and the parser of its outputs."""

    prompt_ids: list[int]
    params: SamplingParams
    parser: ChatOutputParser


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest) -> PreparedChat:
    """Render and tokenize the prompt, and build what the engine and the parser need (400s for bad
    fields). Shared by chat completions and the Responses API."""
    tools = req.tools if req.tools and req.tool_choice != "none" else None

    def prepare() -> tuple[str, list[int]]:
        text = render_chat(
            ctx.need_tokenizer(),
            req.messages,
            template=ctx.chat_template,
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            template_kwargs=req.chat_template_kwargs,
        )
        return text, ctx.encode(text)

    prompt, prompt_ids = await ctx.off_loop(prepare)
    params = build_sampling_params(
        req,
        prompt_len=len(prompt_ids),
        max_model_len=ctx.client.max_model_len,
        defaults=ctx.sampling_defaults,
        vocab_size=ctx.vocab_size,
    )
    forced = tool_choice_constraint(
        req.tool_choice,
        tools,
        prompt,
        ctx.tool_format is KIMI,
        req.parallel_tool_calls,
    )
    if forced is not None:  # the reply is tool calls, under a grammar: any response_format is for later turns
        params = replace(params, structured_outputs=forced)
    thinking = ctx.parse_reasoning and prompt_opens_reasoning(prompt)
    if thinking and params.structured_outputs is not None:
        # the model reasons freely first; the grammar holds the answer after its </think>
        params = replace(
            params, structured_outputs=replace(params.structured_outputs, after_token=ctx.think_end_id)
        )
    if params.structured_outputs is not None:
        await ctx.compile_structured(params.structured_outputs)
    parser = ChatOutputParser(
        starts_in_reasoning=thinking,
        parse_reasoning=ctx.parse_reasoning,
        tools={t.function.name: t.function.parameters or {} for t in tools} if tools else None,
        tool_format=ctx.tool_format,
    )
    return PreparedChat(prompt_ids, params, parser)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    prepared = await prepare_chat(ctx, req)
    prompt_ids, params, parser = prepared.prompt_ids, prepared.params, prepared.parser
    request_id = random_id("chatcmpl")
    requests = fan_out(request_id, prompt_ids, params, req.n)
    index = {rid: i for i, (rid, _, _) in enumerate(requests)}
    try:
        await ctx.warm_prefix([prompt_ids], req.n, raw)
    except ClientDisconnected:
        return Response(status_code=499)
    group = await ctx.submit(requests)
    if req.stream:
        events = _stream(
            ctx, group, parser, index, request_id, model, len(prompt_ids), params.logprobs, req.stream_options
        )
        return StreamingResponse(ctx.guarded(group, events), media_type="text/event-stream")

    try:
        final = await ctx.collect(group, raw)
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for rid, i in index.items():
        completion = final[rid].outputs[0]
        parsed = parser.parse(completion.text, final=True, cut=completion.finish_reason == "length")
        calls = to_openai_tool_calls(parsed.tool_calls) or None
        content: str | None = parsed.content
        if not content and (calls or parsed.reasoning):
            content = None
        message = AssistantMessage(
            content=content,
            reasoning_content=parsed.reasoning or None,
            reasoning=parsed.reasoning or None,
            tool_calls=calls,
        )
        logprobs = None
        if params.logprobs is not None:
            logprobs = chat_logprobs(completion.logprobs or [], params.logprobs, ctx.token_text)
        reason = finish_reason(completion.finish_reason, bool(calls))
        choices.append(ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason))
    prompt_logprobs = None
    if req.prompt_logprobs is not None:  # vLLM's: the rendered prompt's tokens, scored in its prefill
        first = final[next(iter(index))].prompt_logprobs
        prompt_logprobs = vllm_prompt_logprobs(first, req.prompt_logprobs, ctx.token_text)
    response = ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=usage_of(len(prompt_ids), list(final.values())),
        prompt_logprobs=prompt_logprobs,
    )
    payload = response.model_dump(mode="json")
    if payload["prompt_logprobs"] is None:  # vLLM's field, there only when asked for
        del payload["prompt_logprobs"]
    return JSONResponse(payload)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def chunk_event(chunk: ChatCompletionChunk) -> str:
    payload = chunk.model_dump(mode="json")
    for choice in payload["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if payload["usage"] is None:
        del payload["usage"]
    return sse(payload)


async def _stream(
    ctx: ServerContext,
    group: RequestGroup,
    parser: ChatOutputParser,
    index: dict[str, int],
    request_id: str,
    model: str,
    prompt_tokens: int,
    logprobs: int | None,
    options: StreamOptions | None,
) -> AsyncIterator[str]:
    created = int(time.time())
    continuous = bool(options and options.continuous_usage_stats)

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        if usage is None and continuous:
            usage = usage_of(prompt_tokens, list(latest.values()))
        return chunk_event(
            ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
        )

    states = {rid: ChatStreamState(parser) for rid in index}
    latest: dict[str, RequestOutput] = {}
    yield chunk(
        [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in index.values()]
    )
    try:
        async for outputs in group:
            for out in outputs:
                raise_if_failed(out)  # failed in the engine: the stream ends with an error event
                latest[out.request_id] = out
                state, completion = states[out.request_id], out.outputs[0]
                # the engine sends deltas: what this step (or the steps merged into it) added
                cut = completion.finish_reason == "length"
                reasoning, content, calls = state.feed(completion.text, completion.finished, cut)
                new_logprobs = None
                if logprobs is not None and completion.logprobs:
                    new_logprobs = chat_logprobs(completion.logprobs, logprobs, ctx.token_text)
                reason = finish_reason(completion.finish_reason, state.calls_sent > 0)
                if reasoning or content or calls or new_logprobs or reason:
                    delta = ChatDelta(
                        reasoning_content=reasoning,
                        reasoning=reasoning,
                        content=content,
                        tool_calls=calls or None,
                    )
                    choice = ChatChunkChoice(
                        index=index[out.request_id], delta=delta, logprobs=new_logprobs, finish_reason=reason
                    )
                    yield chunk([choice])
    except Exception as exc:  # the engine failed or the server is draining: tell the client in-band
        yield sse(error_body(*failure_of(exc)))
        yield "data: [DONE]\n\n"
        return
    if options and options.include_usage:
        yield chunk([], usage_of(prompt_tokens, list(latest.values())))
    yield "data: [DONE]\n\n"
