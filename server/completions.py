"""POST /v1/completions (the legacy text-completion endpoint)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .chat import sse, usage_of
from .context import ClientDisconnected, ServerContext
from .engine_client import RequestGroup
from .errors import bad_request, error_body, failure_of, raise_if_failed
from .logprobs import completion_logprobs, prompt_completion_logprobs, vllm_prompt_logprobs
from .protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    StreamOptions,
    Usage,
    random_id,
)
from .request_params import build_sampling_params, fan_out

if TYPE_CHECKING:
    from deltaserve.engine.outputs import CompletionOutput, RequestOutput


def _prompts(
    ctx: ServerContext, prompt: str | list[str] | list[int] | list[list[int]], echo: bool
) -> list[tuple[str, list[int]]]:
    """Every prompt as (text, token ids); token-id prompts are decoded only to be echoed."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]  # type: ignore[list-item]
    out = []
    for item in prompt:
        if isinstance(item, str):
            out.append((item, ctx.encode(item)))
            continue
        bad = [t for t in item if not 0 <= t < ctx.vocab_size]  # type: ignore[union-attr]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", "prompt")
        ids = list(item)  # type: ignore[arg-type]
        out.append((ctx.decode(ids) if echo and ctx.tokenizer is not None else "", ids))
    return out


def without_unasked(response: CompletionResponse) -> dict[str, Any]:
    """The response as JSON, vLLM's `prompt_logprobs` left out of choices that did not ask."""
    payload = response.model_dump(mode="json")
    for choice in payload["choices"]:
        if choice["prompt_logprobs"] is None:
            del choice["prompt_logprobs"]
    return payload


class _Choice:
    """One choice's text and logprobs, echo included, from the engine's output."""

    def __init__(
        self, ctx: ServerContext, prompt: tuple[str, list[int]], echo: bool, logprobs: int | None
    ) -> None:
        self.ctx, self.echo, self.logprobs = ctx, echo, logprobs
        self.prompt_text, self.prompt_ids = prompt

    def text(self, completion: CompletionOutput) -> str:
        return (self.prompt_text if self.echo else "") + completion.text

    def logprobs_of(
        self,
        out: RequestOutput,
        echo_prompt: bool = False,
        text_start: int | None = None,
    ) -> CompletionLogprobs | None:
        """The completion's logprobs (the prompt's before them with `echo_prompt`); `text_start`
        is the text offset of its first token (by default where the generated text starts)."""
        if self.logprobs is None:
            return None
        completion = out.outputs[0]
        if text_start is None:
            text_start = len(self.prompt_text) if self.echo else 0
        generated = completion_logprobs(
            completion.logprobs or [], self.logprobs, self.ctx.token_text, text_start
        )
        if not echo_prompt:
            return generated
        echoed = prompt_completion_logprobs(
            self.prompt_ids, self.ctx.token_text, out.prompt_logprobs, self.logprobs
        )
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(echoed, name).extend(getattr(generated, name))
        return echoed


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    prompts = await ctx.off_loop(_prompts, ctx, req.prompt, req.echo)
    request_id = random_id("cmpl")
    requests, choices = [], []
    for j, (text, ids) in enumerate(prompts):
        params = build_sampling_params(
            req,
            prompt_len=len(ids),
            max_model_len=ctx.client.max_model_len,
            defaults=ctx.sampling_defaults,
            vocab_size=ctx.vocab_size,
        )
        if j == 0 and params.structured_outputs is not None:  # one grammar for every prompt
            await ctx.compile_structured(params.structured_outputs)
        requests += fan_out(f"{request_id}-{j}", ids, params, req.n)
        choices += [_Choice(ctx, (text, ids), req.echo, params.logprobs)] * req.n
    index = {rid: i for i, (rid, _, _) in enumerate(requests)}
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    try:
        await ctx.warm_prefix([ids for _, ids in prompts], req.n, raw)
    except ClientDisconnected:
        return Response(status_code=499)
    group = await ctx.submit(requests)
    if req.stream:
        events = _stream(group, index, choices, request_id, model, prompt_tokens, req.stream_options)
        return StreamingResponse(ctx.guarded(group, events), media_type="text/event-stream")

    try:
        final = await ctx.collect(group, raw)
    except ClientDisconnected:
        return Response(status_code=499)
    out = []
    for rid, i in index.items():
        completion = final[rid].outputs[0]
        logprobs = choices[i].logprobs_of(final[rid], echo_prompt=req.echo)
        asked = req.prompt_logprobs
        prompt_logprobs = None
        if asked is not None:
            prompt_logprobs = vllm_prompt_logprobs(final[rid].prompt_logprobs, asked, ctx.token_text)
        out.append(
            CompletionChoice(
                index=i,
                text=choices[i].text(completion),
                logprobs=logprobs,
                finish_reason=completion.finish_reason,
                prompt_logprobs=prompt_logprobs,
            )
        )
    usage = _with_prompt(usage_of(0, list(final.values())), prompt_tokens, list(final.values()))
    return JSONResponse(
        without_unasked(CompletionResponse(id=request_id, model=model, choices=out, usage=usage))
    )


def _with_prompt(usage: Usage, prompt_tokens: int, outputs: list[RequestOutput]) -> Usage:
    usage.prompt_tokens = prompt_tokens
    usage.total_tokens = prompt_tokens + usage.completion_tokens
    # n copies of a prompt share their prompt tokens: count each prompt's cache hits once.
    per_prompt: dict[str, int] = {}
    for out in outputs:
        key = out.request_id.rsplit("-", 1)[0]
        per_prompt[key] = max(per_prompt.get(key, 0), out.num_cached_tokens)
    usage.prompt_tokens_details.cached_tokens = min(prompt_tokens, sum(per_prompt.values()))
    return usage


async def _stream(
    group: RequestGroup,
    index: dict[str, int],
    choices: list[_Choice],
    request_id: str,
    model: str,
    prompt_tokens: int,
    options: StreamOptions | None,
) -> AsyncIterator[str]:
    created = int(time.time())
    continuous = bool(options and options.continuous_usage_stats)

    def usage_now() -> Usage:
        outs = list(latest.values())
        return _with_prompt(usage_of(0, outs), prompt_tokens, outs)

    def chunk(choice: CompletionChoice | None, usage: Usage | None = None) -> str:
        if usage is None and continuous:
            usage = usage_now()
        response = CompletionResponse(
            id=request_id, created=created, model=model, choices=[choice] if choice else [], usage=usage
        )
        payload = without_unasked(response)
        if usage is None:
            del payload["usage"]
        return sse(payload)

    offsets: dict[str, int] = {}  # where the next token's text starts (logprobs' text_offset)
    latest: dict[str, RequestOutput] = {}
    try:
        async for outputs in group:
            for out in outputs:
                raise_if_failed(out)  # failed in the engine: the stream ends with an error event
                # the engine sends deltas: what this step (or the steps merged into it) added
                rid, completion = out.request_id, out.outputs[0]
                latest[rid] = out
                choice = choices[index[rid]]
                first = rid not in offsets
                delta = choice.text(completion) if first else completion.text
                logprobs = choice.logprobs_of(
                    out, echo_prompt=choice.echo and first, text_start=offsets.get(rid)
                )
                if logprobs is not None and logprobs.tokens:
                    offsets[rid] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                else:
                    offsets.setdefault(rid, len(choice.prompt_text) if choice.echo else 0)
                if delta or completion.finish_reason or (logprobs and logprobs.tokens):
                    yield chunk(
                        CompletionChoice(
                            index=index[rid],
                            text=delta,
                            logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                        )
                    )
    except Exception as exc:  # the engine failed or the server is draining: tell the client in-band
        yield sse(error_body(*failure_of(exc)))
        yield "data: [DONE]\n\n"
        return
    if options and options.include_usage:
        yield chunk(None, usage_now())
    yield "data: [DONE]\n\n"
