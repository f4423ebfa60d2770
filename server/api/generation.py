"""The way one chat or text completion runs: its engine requests (one per prompt and choice) are
submitted together, then streamed as server-sent events or collected into one response.

`Generation` holds the flow: warming a shared prompt for n > 1, submitting, the stream's loop
(failed outputs, continuous and final usage, an engine failure as an in-band error event, the
closing `[DONE]`), a client that hangs up (499) and usage. Its subclasses in `chat.py` and
`completions.py` give only what differs: the chunk each output makes and the final response.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic_core import to_json

from ..engine_client import RequestGroup
from ..errors import failure_body, raise_if_failed
from ..protocol import PromptTokensDetails, SamplingRequest, Usage, random_id
from .context import ServerContext
from .json_body import encode
from .logprobs import TokenText, token_text_for
from .request_params import client_name, fan_out, rid_prefix

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import RequestOutput
    from deltaserve.engine.requests.sampling_params import SamplingParams
    from deltaserve.models.vision.positions import ImageInputs

    from ..engine_client import EngineRequest

DONE = "data: [DONE]\n\n"
_PLACEHOLDER = "\x00deltaserve-text\x00"  # no text the detokenizer makes holds a NUL pair around this
_PLACEHOLDER_JSON = to_json(_PLACEHOLDER).decode()


class _Indexed(Protocol):
    index: int


ChunkChoice = TypeVar("ChunkChoice", bound=_Indexed)


def sse(payload: dict[str, Any]) -> str:
    """`payload` as a server-sent event, any `Encoded` part in it spliced in."""
    return f"data: {encode(payload, strict=False).data.decode()}\n\n"


def usage_of(prompt_tokens: int, outputs: list[RequestOutput]) -> Usage:
    """Usage over a request's outputs. The n choices of a prompt share its tokens, so each
    prompt's cache hits count once (an engine request's id is its prompt's id, `-`, its choice)."""
    completion = sum(c.num_tokens for out in outputs for c in out.outputs)
    per_prompt: dict[str, int] = {}
    for out in outputs:
        key = out.request_id.rsplit("-", 1)[0]
        per_prompt[key] = max(per_prompt.get(key, 0), out.num_cached_tokens)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(prompt_tokens, sum(per_prompt.values()))),
    )


class Generation(ABC, Generic[ChunkChoice]):
    """One OpenAI request's engine requests and the way they run; `ChunkChoice` is the type of a
    stream chunk's choice."""

    chunk_type: ClassVar[type[BaseModel]]  # a stream chunk: id, created, model, choices, usage
    id_prefix: ClassVar[str]  # the reply's id's: chatcmpl, cmpl

    def __init__(self, ctx: ServerContext, model: str, req: SamplingRequest) -> None:
        self.ctx, self.model, self.req = ctx, model, req
        self.request_id = random_id(self.id_prefix)  # the engine requests' ids start with it (unique)
        self.response_id = self.request_id  # the reply's id (`respond`: the client's name, if it gives one)
        self.stream_options = stream_options = req.stream_options
        self.created = int(time.time())
        self.requests: list[EngineRequest] = []
        self.index: dict[str, int] = {}  # engine request id -> its choice's index
        self.prompts: list[list[int]] = []
        self.n = 1  # choices per prompt
        self.latest: dict[str, RequestOutput] = {}  # each engine request's latest output, streaming
        self._templates: dict[int, tuple[str, str]] = {}  # text_event's, by choice index
        # vLLM's: only beside include_usage, which turns usage off when false
        self.usage_in_every_chunk = bool(
            stream_options and stream_options.include_usage and stream_options.continuous_usage_stats
        )

    def add(
        self, prompt_id: str, prompt_ids: list[int], params: SamplingParams, images: ImageInputs | None = None
    ) -> None:
        """A prompt and its `params.n` choices, indexed after those added before."""
        self.prompts.append(prompt_ids)
        self.n = params.n
        for request in fan_out(prompt_id, prompt_ids, params, images):
            self.index[request[0]] = len(self.requests)
            self.requests.append(request)

    @property
    def token_text(self) -> TokenText:
        """How this request's logprobs name tokens: their text, or `token_id:N` where it asks."""
        return token_text_for(self.req, self.ctx.token_text)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    def usage(self, outputs: list[RequestOutput]) -> Usage:
        return usage_of(self.prompt_tokens, outputs)

    def choices_usage(self, indices: list[int]) -> Usage:
        """vLLM's continuous usage: a chunk's own choices' prompt and tokens so far, not the
        whole request's (a chunk holds one choice)."""
        prompts = {i // self.n for i in indices}
        outputs = [out for i in indices if (out := self.latest.get(self.requests[i][0])) is not None]
        return usage_of(sum(len(self.prompts[p]) for p in prompts), outputs)

    async def respond(self, raw: Request, stream: bool) -> Response:
        """Submit every request, then stream the chunks or answer with the whole response. A
        client that names the request (vLLM's X-Request-Id header, or the body's request_id) gets
        that name in the reply's id."""
        given = client_name(raw, self.req)
        if given:
            self.response_id = f"{self.id_prefix}-{given}"
            self._name_requests(rid_prefix(given))
        return await self.ctx.run(
            self.requests, raw, stream, self._events, self.response, self.prompts, self.n
        )

    def _name_requests(self, prefix: str) -> None:
        """Engine ids that start with the client's name for the request: /abort_request ends
        them by it."""
        self.requests = [(prefix + r[0], *r[1:]) for r in self.requests]  # type: ignore[misc]
        self.index = {prefix + rid: i for rid, i in self.index.items()}

    def event(self, choices: list[ChunkChoice], usage: Usage | None = None, **fields: Any) -> str:
        """A chunk as a server-sent event, with the usage so far where the client asked for it;
        `fields`: the chunk's other fields."""
        if usage is None and self.usage_in_every_chunk:
            usage = self.choices_usage([c.index for c in choices])
        chunk = self.chunk_type(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            **fields,
        )
        return f"data: {self.chunk_json(chunk)}\n\n"

    async def _events(self, group: RequestGroup) -> AsyncIterator[str]:
        for opening in self.opening_events():
            yield opening
        try:
            async for outputs in group:
                for i, out in enumerate(outputs):
                    if i:  # one step's outputs of many choices: other requests are served between them
                        await asyncio.sleep(0)
                    raise_if_failed(out)  # failed in the engine: the stream ends with an error event
                    self.latest[out.request_id] = out
                    # the engine sends deltas: what this step (or the steps merged into it) added
                    event = self.delta_event(out)
                    if event is not None:
                        yield event
        except Exception as exc:  # the engine failed or the server is draining: tell the client in-band
            yield sse(failure_body(exc))
            yield DONE
            return
        if self.stream_options and self.stream_options.include_usage:
            yield self.event([], self.usage(list(self.latest.values())))
        yield DONE

    def delta_event(self, out: RequestOutput) -> str | None:
        """The event of what `out` adds; None when it adds nothing to send."""
        choice = self.delta_choice(out)
        return None if choice is None else self.event([choice])

    def text_event(self, index: int, text: str, choice: Callable[[str], ChunkChoice]) -> str:
        """`self.event([choice(text)])` for chunks that differ only in that text: the event of
        choice `index` is rendered once around a placeholder and filled in after, with pydantic's
        own string encoding. Building and dumping the models was the larger part of a streamed
        token's cost in this process. Only for chunks without usage."""
        template = self._templates.get(index)
        if template is None:
            head, found, tail = self.event([choice(_PLACEHOLDER)]).partition(_PLACEHOLDER_JSON)
            assert found and _PLACEHOLDER_JSON not in tail, "the placeholder must appear once"
            template = self._templates[index] = (head, tail)
        return template[0] + to_json(text).decode() + template[1]

    def opening_events(self) -> list[str]:
        """The events that open the stream, before any output (none by default)."""
        return []

    @abstractmethod
    def delta_choice(self, out: RequestOutput) -> ChunkChoice | None:
        """The chunk choice of what `out` adds; None when it adds nothing to send."""

    def chunk_json(self, chunk: BaseModel, exclude: dict[str, Any] | None = None) -> str:
        """A stream chunk as JSON text, without its usage until there is one. pydantic's own
        encoder: json.dumps of model_dump was the larger part of each streamed token's cost."""
        exclude = dict(exclude or {})
        if getattr(chunk, "usage", None) is None:
            exclude["usage"] = True
        return chunk.model_dump_json(exclude=exclude or None)

    async def response(self, final: dict[str, RequestOutput]) -> Response:
        """The whole response from every engine request's final output."""
        choices = [self.final_choice(i, final[rid]) for rid, i in self.index.items()]
        return JSONResponse(self.response_json(choices, final))

    @abstractmethod
    def final_choice(self, index: int, out: RequestOutput) -> BaseModel:
        """Choice `index` of the whole response, from its engine request's final output."""

    @abstractmethod
    def response_json(self, choices: list[Any], final: dict[str, RequestOutput]) -> dict[str, Any]:
        """The whole response as JSON, around its choices."""
