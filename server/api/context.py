"""What every handler needs: the engine client, the served names, the prompt tools and the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from deltaserve.engine.errors import EngineDeadError, EngineFaultError, QueueFullError
from deltaserve.engine.requests.generation_defaults import SamplingDefaults
from deltaserve.engine.requests.sampling_params import grammar_timeout_s

from ..edge import ARRIVED
from ..engine_client import EngineClient, RequestGroup, ShuttingDownError
from ..errors import APIError, RequestFailedError, bad_request, failure_of, quoted, raise_if_failed, refused
from ..metrics import Metrics
from ..text.prompt_bound import chars_per_token
from ..text.tool_calls import tool_call_format
from .images import ImageReader
from .logprobs import TokenText
from .request_params import bad_words_token_ids, build_sampling_params

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import RequestOutput
    from deltaserve.engine.requests.sampling_params import SamplingParams, StructuredOutputs

    from ..engine_client import EngineRequest
    from ..protocol import ChatCompletionRequest, CompletionRequest


T = TypeVar("T")
logger = logging.getLogger("deltaserve.requests")

# requests whose prompts are rendered and tokenized at once: a long prompt holds one worker, not all
PROMPT_WORKERS = 16
# a text this long takes the tokenizer many times its own memory (each token's string and offsets)
LONG_TEXT_CHARS = 1 << 20
_long_text = threading.Lock()


def text_chars(value: Any) -> int:
    """The characters of the strings in a request's prompt or messages, at any depth (a model's
    fields, lists, dicts), to send a long one to the long-text worker before it takes a worker; an
    image's data URL is not tokenized, and counts nothing."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += 0 if item.startswith("data:") else len(item)
        elif isinstance(item, BaseModel):
            pending.extend(item.__dict__.values())
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return total


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """The text's token ids; texts of LONG_TEXT_CHARS or more one at a time, whichever prompt
    worker encodes them, so that many at once do not hold many times the memory."""
    with _long_text if len(text) >= LONG_TEXT_CHARS else contextlib.nullcontext():
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the same ids; transformers' wrapper would build several more
            # million-element lists with the GIL held, stalling every stream of the event loop.
            # encode_batch, not encode: only the batch call lets go of the GIL while it works
            (encoding,) = backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(encoding.ids)
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


# what the server sets for its own ends, never a request: the log shows what the request asked for
_SERVER_SET = frozenset(
    {"output_kind", "detokenize", "internal", "next_turn_len", "shared_prefix_len", "bad_words_token_ids"}
)


def request_line(request_id: str, prompt_ids: list[int], params: SamplingParams, max_ids: int | None) -> str:
    """One request as --enable-log-requests logs it: its prompt's ids (the first `max_ids`) and the
    parameters it sets beside their defaults."""
    from deltaserve.engine.requests.sampling_params import SamplingParams

    shown = prompt_ids if max_ids is None else prompt_ids[:max_ids]
    more = f" ... ({len(prompt_ids) - len(shown)} more)" if len(shown) < len(prompt_ids) else ""
    default = SamplingParams()
    changed = {
        f.name: getattr(params, f.name)
        for f in fields(params)
        if getattr(params, f.name) != getattr(default, f.name) and f.name not in _SERVER_SET
    }
    return f"request {request_id}: {len(prompt_ids)} prompt tokens {shown}{more}, params {changed}"


def share_scoring(
    requests: Sequence[EngineRequest],
) -> tuple[list[EngineRequest], list[EngineRequest], dict[str, str]]:
    """Requests that repeat a prompt with prompt_logprobs (a prompt's n > 1 choices): one
    scoring warm-up a prompt computes them, and the copies drop them (`scores_once`), where each
    computed them over the whole prompt, cache unused. Gives the copies, the warm-ups, and each
    copy's warm-up id."""
    from deltaserve.engine.cache.adapter import scores_once, scoring_params, unscored

    alike: dict[tuple[Any, ...], list[int]] = {}
    for i, (_, ids, params, *images) in enumerate(requests):
        if params.prompt_logprobs is not None:
            asked = tuple(params.prompt_logprob_token_ids or ())
            key = (
                tuple(ids),
                params.prompt_logprobs,
                asked,
                params.max_tokens == 0,
                id(images[0]) if images else None,
            )
            alike.setdefault(key, []).append(i)
    copies: list[EngineRequest] = list(requests)
    warm: list[EngineRequest] = []
    scored_by: dict[str, str] = {}
    for members in alike.values():
        _, ids, params, *images = requests[members[0]]
        if not scores_once(params, len(members)):
            continue
        warm_id = f"{requests[members[0]][0]}-score"  # under the client's name: /abort_request ends it
        warm.append((warm_id, ids, scoring_params(params), *images))  # type: ignore[arg-type]
        for i in members:
            rid, ids, params, *rest = requests[i]
            copies[i] = (rid, ids, unscored(params), *rest)  # type: ignore[assignment]
            scored_by[rid] = warm_id
    return copies, warm, scored_by


class ClientDisconnected(Exception):
    """The client hung up before its answer: the handler answers 499 (which no one reads)."""


async def hung_up(request: Request) -> None:
    """Return once the client of `request` (whose body was read) has hung up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class ServerContext:
    client: EngineClient
    model_names: list[str]
    metrics: Metrics
    chat_template: str | None = None
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    api_key: str | None = None
    model_aliases: list[str] = field(default_factory=list)  # accepted, not listed by /v1/models
    log_requests: bool = False  # a log line for each engine request: its prompt's ids and parameters
    max_log_len: int | None = None  # ... showing at most this many of the prompt's ids
    image_limit: int | None = None  # --limit-mm-per-prompt's "image"
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered
    force_include_usage: bool = False  # every stream ends with its usage chunk (vLLM's flag)
    content_format: str = "auto"  # openai: messages' content reaches the template as a list of parts

    def __post_init__(self) -> None:
        self.tokenizer: Any = self.client.tokenizer
        self.token_text = TokenText(self.tokenizer)
        vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
        # Split <think> sections only for tokenizers that have them (the Qwen family).
        self.parse_reasoning = "<think>" in vocab and "</think>" in vocab
        # where a prompt opens <think>, structured outputs start after the model's </think>
        self.think_end_id: int | None = vocab.get("</think>") if self.parse_reasoning else None
        self.tool_format = tool_call_format(vocab)  # Qwen's <tool_call> or Kimi's markers
        self._prompt_workers = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="deltaserve-prompt")
        # long texts wait for one another here, not in prompt workers that short prompts need
        self._long_text_worker = ThreadPoolExecutor(1, thread_name_prefix="deltaserve-long-prompt")
        self.chars_per_token = chars_per_token(self.tokenizer) if self.tokenizer is not None else None
        self.vocab_size = int(self.client.vocab_size or (len(self.tokenizer) if self.tokenizer else 0))
        self.images = ImageReader.from_model_info(self.client.model_info, self.image_limit)

    def template_for(self, requested: str | None) -> str | None:
        """The template a request renders with: its own (a 400 unless the server trusts them) or
        the server's."""
        if requested is None:
            return self.chat_template
        if not self.trust_request_chat_template:
            # a template from the request runs a stranger's Jinja in the server (sandboxed, still)
            raise bad_request(
                "chat_template: not supported in a request unless the server is started with "
                "--trust-request-chat-template (or give the server one: --chat-template)",
                "chat_template",
            )
        return requested

    async def off_loop(self, fn: Callable[..., T], *args: Any, chars: int = 0) -> T:
        """Run template rendering and tokenization beside the event loop, so a long prompt does not
        stall the streams of others, in one of several workers, so that it holds up no other
        request's prompt: `encode`'s Rust tokenizer lets go of the GIL while it works, and its
        concurrent callers only read it. Work on `chars` of LONG_TEXT_CHARS or more runs in the one
        long-text worker, as `encode_text` takes such texts one at a time anyway."""
        long = chars >= LONG_TEXT_CHARS
        return await asyncio.get_running_loop().run_in_executor(
            self._long_text_worker if long else self._prompt_workers, functools.partial(fn, *args)
        )

    def force_usage(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        """With --enable-force-include-usage, a streamed request ends with its usage chunk, as if
        its stream_options set include_usage (vLLM's meaning)."""
        if self.force_include_usage and req.stream:
            from ..protocol import StreamOptions

            given = req.stream_options or StreamOptions()
            req.stream_options = given.model_copy(update={"include_usage": True})

    def resolve_model(self, name: str | None) -> str:
        """The name a reply reports: the request's own where it is one of the served names (as vLLM
        and SGLang echo it), else the first."""
        if name is not None and name in self.model_names:
            return name
        if name is None or name in self.model_aliases:
            return self.model_names[0]
        raise APIError(
            404,
            f"the model {quoted(name)} does not exist; this server serves {', '.join(self.model_names)}",
            "model",
            "model_not_found",
        )

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise bad_request("this server was started without a tokenizer; send token ids", "prompt")
        return self.tokenizer

    def refuse_overlong(self, text: str, param: str) -> None:
        """A 400 (context_length_exceeded) for a prompt with more characters than the context's
        tokens can stand for, by its length alone: tokenizing megabytes would hold a prompt worker
        for seconds, and the engine would refuse the prompt anyway."""
        bound = self.chars_per_token
        limit = self.client.max_model_len
        if bound is None or len(text) <= limit * bound.of(text):
            return
        raise bad_request(
            f"this model's maximum context length is {limit} tokens, and a prompt of {len(text)} "
            f"characters is longer than that (its tokens stand for at most {bound.of(text)} characters "
            f"each); shorten the prompt",
            param,
            code="context_length_exceeded",
        )

    def refuse_overlong_ids(self, ids: Sequence[int], param: str) -> None:
        """A 400 (context_length_exceeded) for a token-id prompt longer than the context, before
        its ids are checked or decoded (for an echo), which would hold a prompt worker."""
        limit = self.client.max_model_len
        if len(ids) > limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, and the prompt has "
                f"{len(ids)}; shorten the prompt",
                param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return encode_text(self.need_tokenizer(), text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.need_tokenizer().decode(token_ids, skip_special_tokens=False)

    def sampling_params(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_len: int,
        bad_words: list[list[int]] | None = None,
        warn: bool = True,
        greedy_copies: bool = False,
    ) -> SamplingParams:
        """The request's engine parameters under this server's context length, generation defaults
        and vocabulary (`request_params.build_sampling_params`: 400s for bad values); `bad_words`
        as `bad_words_ids` tokenized them; `warn` and `greedy_copies` as `build_sampling_params`'."""
        params = build_sampling_params(
            req,
            prompt_len=prompt_len,
            max_model_len=self.client.max_model_len,
            defaults=self.sampling_defaults,
            vocab_size=self.vocab_size,
            warn=warn,
            greedy_copies=greedy_copies,
        )
        if params.thinking_token_budget not in (None, -1) and self.think_end_id is None:
            raise bad_request(
                "thinking_token_budget needs a model whose tokenizer has <think> and </think>, and this one's does not",
                "thinking_token_budget",
            )
        return replace(params, bad_words_token_ids=bad_words) if bad_words else params

    async def bad_words_ids(self, req: ChatCompletionRequest | CompletionRequest) -> list[list[int]] | None:
        """The request's `bad_words` as token sequences, tokenized in a prompt worker."""
        if req.bad_words and self.tokenizer is None:
            raise bad_request(
                "bad_words need a tokenizer, which this server was started without", "bad_words"
            )
        if not req.bad_words:
            return None
        return await self.off_loop(bad_words_token_ids, req.bad_words, self.encode)

    async def compile_structured(
        self, spec: StructuredOutputs, param: str, raw: Request | None = None
    ) -> None:
        """Have the engine compile a request's grammar into its cache before the request is
        submitted, on a worker thread beside its step loop: a new JSON schema can take xgrammar a
        while, which the step loop would otherwise spend admitting it while every stream waits. A
        bad schema is a 400 here, naming `param`, the field it came from.
        `raw`: the HTTP request it is for; a client that hangs up meanwhile gets ClientDisconnected
        at once (the engine compiles on, for the next request that asks the same grammar). A
        grammar not compiled within `grammar_timeout_s()` is a 400 (SGLang's timeout)."""
        timeout = grammar_timeout_s()
        compiling = asyncio.ensure_future(self.client.call("compile_structured", spec))
        watcher = asyncio.ensure_future(hung_up(raw)) if raw is not None else None
        try:
            await asyncio.wait(
                [t for t in (compiling, watcher) if t is not None],
                timeout=timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not compiling.done():
                if watcher is not None and watcher.done():
                    raise ClientDisconnected
                raise bad_request(
                    f"structured outputs: the grammar did not compile within {timeout:g} s",
                    param,
                    code="grammar_timeout",
                )
            await compiling  # its error, if it failed
        except ValueError as exc:
            raise bad_request(str(exc), getattr(exc, "param", None) or param) from exc
        finally:
            compiling.cancel()  # a call no one waits for: its answer is dropped
            if watcher is not None:
                watcher.cancel()

    async def submit(
        self,
        requests: Sequence[EngineRequest],
        track: bool = True,
        engine: int | None = None,
        raw: Request | None = None,
        log: bool | None = None,
    ) -> RequestGroup:
        """Add the requests to the engine. `raw`: the HTTP request they answer; an /abort_request
        that named them after it arrived (while its prompt was prepared) ends them once added.
        `track=False`: left out of the metrics (and, unless `log`, of --log-requests' lines)."""
        if self.log_requests and (track if log is None else log):
            for request_id, prompt_ids, params, *_ in requests:
                logger.info("%s", request_line(request_id, prompt_ids, params, self.max_log_len))
        try:
            arrived = raw.scope.get(ARRIVED) if raw is not None else None
            return await self.client.add(requests, track, engine, arrived)
        except QueueFullError as exc:
            reason = "shutting_down" if isinstance(exc, ShuttingDownError) else "queue_full"
            self.metrics.request_rejected(reason)
            raise APIError(503, str(exc), None, reason) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "engine_unavailable") from exc
        except ValueError as exc:
            raise refused(exc) from exc

    async def warm_prefix(
        self,
        prompts: list[list[int]],
        n: int,
        request: Request,
        scoring: Sequence[EngineRequest] = (),
        copies: Sequence[EngineRequest] = (),
    ) -> tuple[int | None, dict[str, Any]]:
        """Before n > 1 copies of each prompt: prefill each once (`warmup_prompts`), with the
        images and priority of its `copies`, and the `scoring` warm-ups (`share_scoring`) that
        compute prompt logprobs for copies. Gives the engine that did (the copies' engine, with
        data parallelism) and each scoring warm-up's prompt logprobs by its id. A client that
        hangs up meanwhile gets ClientDisconnected, as from `collect`."""
        from deltaserve.engine.cache.adapter import warmup_params, warmup_prompts

        info = self.client.model_info
        scored = {tuple(r[1]) for r in scoring}  # a scoring warm-up's prefill warms the cache itself
        warm = warmup_prompts(
            [p for p in prompts if tuple(p) not in scored] if n > 1 else [],
            str(info.get("cache_type")),
            int(info.get("page_size", 16)),
        )
        # a warm-up without its prompt's images would cache a text the copies never match
        of = {
            tuple(ids[:-1]): (rid, ids[-1], params, rest[0] if rest else None)
            for rid, ids, params, *rest in copies
        }
        requests: list[EngineRequest] = []
        for p in warm:
            rid, last, params, inputs = of.get(tuple(p), (uuid.uuid4().hex, None, None, None))
            warm_id = f"{rid}-warm"  # under the client's name: /abort_request ends it
            # at the copies' priority: they wait for it
            warm_params = replace(
                warmup_params(),
                priority=params.priority if params else 0,
                cache_salt=params.cache_salt if params else None,  # cached where the copies look
            )
            if inputs is None:
                requests.append((warm_id, p, warm_params))
            elif last != self.images.image_token_id:  # else the prompt less its last token splits an image
                requests.append((warm_id, p, warm_params, inputs))
        requests += scoring
        if not requests:
            return None, {}
        group = await self.submit(requests, track=False)
        final = await self.collect(group, request)
        return group.engine, {r[0]: final[r[0]].prompt_logprobs for r in scoring}

    async def collect(self, group: RequestGroup, request: Request) -> dict[str, RequestOutput]:
        """Wait for a whole group; a client that hangs up meanwhile aborts it (ClientDisconnected)."""

        async def watch() -> None:
            await hung_up(request)
            group.queue.put_nowait(ClientDisconnected())  # wakes the reader, whose `finally` aborts

        watcher = asyncio.ensure_future(watch())
        final: dict[str, RequestOutput] = {}
        try:
            async for outputs in group:
                for out in outputs:
                    raise_if_failed(out)
                    final[out.request_id] = out
        except RequestFailedError as exc:
            raise APIError(500, "internal error", None, "internal_error") from exc
        except (QueueFullError, EngineDeadError, EngineFaultError) as exc:
            status, message = failure_of(exc)
            code = "engine_unavailable" if status == 503 else "engine_error"
            if isinstance(exc, ShuttingDownError):  # the drain's time ran out: as its refusals say
                code = "shutting_down"
            raise APIError(status, message, None, code) from exc
        finally:
            watcher.cancel()
            self.client.abort(group)
        return final

    async def run(
        self,
        requests: Sequence[EngineRequest],
        raw: Request,
        stream: bool,
        events: Callable[[RequestGroup], AsyncIterator[str]],
        answer: Callable[[dict[str, RequestOutput]], Awaitable[Response]],
        prompts: list[list[int]],
        n: int,
    ) -> Response:
        """Prefill a prompt shared by n > 1 samples once, submit every request, then stream
        `events` of the group or `answer` with the final outputs; a client that hangs up gets 499."""
        requests, scoring, scored_by = share_scoring(requests)
        try:
            engine, scores = await self.warm_prefix(prompts, n, raw, scoring, requests)
        except ClientDisconnected:
            return Response(status_code=499)
        group = await self.submit(requests, engine=engine, raw=raw)
        group.prompt_logprobs = {rid: scores[warm_id] for rid, warm_id in scored_by.items()}
        if stream:
            return StreamingResponse(self.guarded(group, events(group)), media_type="text/event-stream")
        try:
            final = await self.collect(group, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        return await answer(final)

    async def guarded(self, group: RequestGroup, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Stream events; however the stream ends (done, client gone, server draining), free the group."""
        try:
            async for event in events:
                yield event
        finally:
            self.client.abort(group)
