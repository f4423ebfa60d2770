"""vLLM's `use_beam_search` on /v1/completions: the n best beams of each prompt
(`engine/requests/beam_search.py`), each step's beams sent to the engine as one-token requests
that ask for 2n log-probabilities, so that the prefix cache serves what the beams share."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deltaserve.engine.requests.beam_search import BeamSearch, BeamSearchParams
from deltaserve.engine.requests.sampling_params import SamplingParams

from ..errors import bad_request
from ..protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from .context import ClientDisconnected, ServerContext

_UNSCORED = (
    "logprobs",
    "stop",
    "stop_token_ids",
    "bad_words",
    "logit_bias",
    "allowed_token_ids",
    "min_tokens",
)


async def beam_search_completion(
    ctx: ServerContext, req: CompletionRequest, raw: Request, model: str, prompts: list[tuple[str, list[int]]]
) -> Response:
    if req.stream:
        raise bad_request("use_beam_search answers once the search ends: send stream false", "stream")
    for name in _UNSCORED:
        if getattr(req, name):
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    try:
        params = BeamSearchParams(
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
    limit = ctx.client.max_model_len
    for _, ids in prompts:
        if len(ids) + max_tokens > limit:
            raise bad_request(
                f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} exceed the context of {limit}",
                "max_tokens",
                code="context_length_exceeded",
            )
    search = BeamSearch([ids for _, ids in prompts], params, ctx.client.eos_token_ids)
    step = SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=2 * req.n, ignore_eos=True, detokenize=False
    )
    base = f"beam-{uuid.uuid4().hex}"
    while not search.finished:
        requests = [
            (f"{base}-{search.steps}-{i}", tokens, step) for i, tokens in enumerate(search.expanding())
        ]
        group = await ctx.submit(requests)
        try:
            final = await ctx.collect(group, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        search.advance([final[r[0]].outputs[0].logprobs[0].top for r in requests])  # type: ignore[index]
    choices: list[CompletionChoice] = []
    completion_tokens = 0
    for (text, _), out in zip(prompts, search.outputs()):
        for beam in out.sequences:
            ids = beam.output_ids
            completion_tokens += len(ids)
            if beam.finish_reason == "stop" and not req.include_stop_str_in_output:
                ids = ids[:-1]
            decoded = (
                ctx.need_tokenizer().decode(ids, skip_special_tokens=req.skip_special_tokens)
                if ctx.tokenizer
                else ""
            )
            choices.append(
                CompletionChoice(
                    index=len(choices),
                    text=(text if req.echo else "") + decoded,
                    logprobs=None,
                    finish_reason=beam.finish_reason,
                )
            )
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    response = CompletionResponse(id=f"cmpl-{base}", model=model, choices=choices, usage=usage)
    payload = response.model_dump(mode="json")
    for choice in payload["choices"]:
        del choice["prompt_logprobs"]  # vLLM's field, for requests that ask for it
    return JSONResponse(payload)
