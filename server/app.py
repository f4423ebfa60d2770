"""The FastAPI application: routes, API-key check, and every error as OpenAI error JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve import __version__
from deltaserve.engine.errors import EngineDeadError, InvalidParamError, QueueFullError
from deltaserve.engine.requests.generation_defaults import SamplingDefaults

from .api.chat import create_chat_completion
from .api.completions import create_completion
from .api.context import ClientDisconnected, ServerContext, text_chars
from .api.generate import GenerateRequest, create_generation
from .api.messages import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    count_tokens,
    create_message,
)
from .api.request_params import rid_prefix
from .api.responses import (
    ResponsesRequest,
    ResponseStore,
    SharedResponseStore,
    StoredResponse,
    create_response,
    list_input_items,
)
from .edge import MAX_BODY_BYTES, EdgeGuard
from .engine_client import EngineClient, ShuttingDownError
from .errors import APIError, anthropic_request, bad_request, error_body, quoted, refused, validation_message
from .metrics import Metrics, SharedMetrics
from .protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightVersionRequest,
)
from .text.chat_template import first_image_part, image_urls, render_chat

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("deltaserve.server")


@dataclass(frozen=True)
class Cors:
    """Which browser origins may call the API, with which methods and headers (vLLM's flags;
    `["*"]`: any)."""

    origins: list[str]
    methods: list[str]
    headers: list[str]
    credentials: bool


def build_app(
    engine_client: EngineClient,
    *,
    model_names: list[str],
    model_aliases: list[str] | None = None,
    chat_template: str | None = None,
    api_key: str | None = None,
    sampling_defaults: SamplingDefaults | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    shared_metrics: SharedMetrics | None = None,
    cors: Cors | None = None,
    log_requests: bool = False,
    max_log_len: int | None = None,
    image_limit: int | None = None,
    trust_request_chat_template: bool = False,
    force_include_usage: bool = False,
    request_id_headers: bool = False,
    api_docs: bool = True,
    chat_template_content_format: str = "auto",
) -> FastAPI:
    """The app for one engine client; the client's engine thread runs for the app's lifespan.
    `api_key` guards /v1, /generate, /tokenize and /detokenize; bodies over `max_body_bytes` are a 413.
    `model_aliases` are accepted in requests like `model_names` but not listed by /v1/models.
    `shared_metrics`: one of several HTTP processes, whose /metrics adds up all of theirs and whose
    stored responses (the Responses API's) live in files of the folder they share.
    `cors`: which browser origins may call the API; None or no origins, no CORS headers.
    `trust_request_chat_template`: a chat request's own `chat_template` is rendered, not a 400.
    `force_include_usage`: every streamed chat or completion ends with its usage chunk.
    `request_id_headers`: every response carries X-Request-Id, a fresh one where the request gave none.
    `api_docs`: /docs, /redoc and /openapi.json are served.
    `chat_template_content_format`: how messages' content reaches the chat template (auto, string, openai)."""
    metrics = engine_client.metrics or Metrics(model_names[0])
    engine_client.metrics = metrics
    ctx = ServerContext(
        engine_client,
        model_names,
        metrics,
        chat_template,
        sampling_defaults or SamplingDefaults(),
        api_key,
        list(model_aliases or []),
        log_requests,
        max_log_len,
        image_limit,
        trust_request_chat_template,
        force_include_usage,
        chat_template_content_format,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine_client.start()
        if shared_metrics is None:
            yield
        else:
            publisher = asyncio.create_task(shared_metrics.publish_every(metrics))
            yield
            publisher.cancel()
            with contextlib.suppress(OSError):
                shared_metrics.publish(metrics)  # the last requests count too
        await engine_client.shutdown()

    hidden: dict[str, Any] = {} if api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="deltaserve", version=__version__, lifespan=lifespan, **hidden)
    app.state.ctx = ctx
    _install_error_handlers(app, metrics)
    app.add_middleware(
        EdgeGuard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        metrics=metrics,
        request_id_headers=request_id_headers,
    )
    if cors is not None and cors.origins:  # outside the guard: a preflight has no key; a 401 wants CORS too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors.origins,
            allow_methods=cors.methods,
            allow_headers=cors.headers,
            allow_credentials=cors.credentials,
        )
    app.add_middleware(_HeadAsGet)  # outermost: the guard, CORS and the routes all see a GET

    v1 = APIRouter(prefix="/v1")

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @v1.post("/messages")  # Anthropic's Messages API
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(ctx, body, request)

    @v1.post("/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> Response:
        return await count_tokens(ctx, body)

    # several HTTP processes: a response stored through one is found through any
    stored = (
        SharedResponseStore(os.path.join(shared_metrics.folder, "responses"))
        if shared_metrics is not None
        else ResponseStore()
    )

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(ctx, body, request, stored)

    def stored_entry(response_id: str) -> StoredResponse:
        entry = stored.get(response_id)
        if entry is None:
            raise APIError(404, f"no response {quoted(response_id)} is stored", "response_id", "not_found")
        return entry

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False) -> Response:
        body = stored_entry(response_id).body
        if stream:  # vLLM's replays a background response's events; none runs in the background here
            raise bad_request(
                "stream is for background responses' events, which this server does not run: "
                "retrieve the response without stream",
                "stream",
            )
        return JSONResponse(body)

    @v1.get("/responses/{response_id}/input_items")  # client.responses.input_items.list
    async def response_input_items(
        response_id: str, request: Request, after: str | None = None, limit: int = 20, order: str = "desc"
    ) -> Response:
        entry = stored_entry(response_id)
        # the SDK sends a list as include[]=...
        include = request.query_params.getlist("include[]") + request.query_params.getlist("include")
        return JSONResponse(list_input_items(entry, after, limit, order, include))

    @v1.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        stored_entry(response_id)  # a response is stored once answered: vLLM's 400 for such
        raise bad_request(
            "Cannot cancel a synchronous response: it was answered in its request "
            "(this server runs no background responses)",
            "response_id",
        )

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        if not stored.delete(response_id):
            raise APIError(404, f"no response {quoted(response_id)} is stored", "response_id", "not_found")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def served_info() -> dict[str, Any]:
        """The engine's own model info: the checkpoint a weight update loaded, through any HTTP
        process (this process's copy is the one it started with)."""
        try:
            return dict(await engine_client.call("model_info"))
        except EngineDeadError:
            return engine_client.model_info

    def card(name: str, info: dict[str, Any]) -> ModelCard:
        root = str(info.get("model", model_names[0]))
        return ModelCard(id=name, root=root, max_model_len=engine_client.max_model_len)

    @v1.get("/models", response_model=ModelList)
    async def models(request: Request) -> Any:
        info = await served_info()
        cards = [card(name, info) for name in model_names]
        if "anthropic-version" in request.headers:  # Anthropic's SDKs: its list, one page of them all
            data = [anthropic_model(c) for c in cards]
            return JSONResponse(
                {"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]}
            )
        return ModelList(data=cards)

    @v1.get("/models/{model_id:path}", response_model=ModelCard)  # a repo id's name has a slash in it
    async def model(model_id: str, request: Request) -> Any:
        if model_id not in model_names and model_id not in (model_aliases or []):
            raise APIError(404, f"the model {quoted(model_id)} does not exist", "model", "model_not_found")
        found = card(model_id, await served_info())
        return JSONResponse(anthropic_model(found)) if "anthropic-version" in request.headers else found

    app.include_router(v1)

    @app.get("/health")
    @app.get("/ping")  # SageMaker's name for it, which vLLM serves too
    @app.post("/ping")  # vLLM's /ping answers POST too, and clients written for it may send one
    async def health() -> Response:
        healthy, why = engine_client.health()
        if healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)

    @app.get("/health_generate")  # SGLang's: healthy once a one-token generation comes back
    async def health_generate(request: Request) -> Response:
        healthy, reason = engine_client.health()
        why = await _generates_one_token(ctx, request) if healthy else reason
        if why is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)

    @app.get("/get_model_info")  # SGLang's
    async def get_model_info() -> dict[str, Any]:
        info = await served_info()
        return {
            "model_path": str(info.get("model", model_names[0])),
            "tokenizer_path": getattr(ctx.tokenizer, "name_or_path", None),
            "is_generation": True,
            "preferred_sampling_params": None,
            "has_image_understanding": ctx.images.processor is not None,
            "has_audio_understanding": False,
            "architectures": [info.get("architecture")],
            "served_model_names": model_names,
            "max_model_len": engine_client.max_model_len,
            "weight_version": info.get("weight_version", "default"),
        }

    @app.get("/get_weight_version")  # SGLang's
    async def get_weight_version() -> dict[str, Any]:
        try:
            info = await engine_client.call("model_info")
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "engine_unavailable") from exc
        return {"weight_version": info.get("weight_version", "default")}

    @app.post("/update_weight_version")  # SGLang's: a new label, the same weights
    async def update_weight_version(body: UpdateWeightVersionRequest) -> Response:
        try:
            if body.abort_all_requests:
                await engine_client.abort_where(None)
            await engine_client.call("set_weight_version", body.new_version)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "engine_unavailable") from exc
        return JSONResponse(
            {"success": True, "message": "the weight version is set", "new_version": body.new_version}
        )

    @app.post("/reset_prefix_cache")  # vLLM's name
    @app.post("/flush_cache")  # SGLang's
    async def reset_prefix_cache() -> Response:
        try:
            await engine_client.call("flush_cache")  # what no running request holds: safe under load
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "engine_unavailable") from exc
        return JSONResponse({"status": "ok"})

    @app.post("/update_weights_from_disk")  # SGLang's
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> Response:
        """Other weights of the served model: new requests wait while the running ones finish
        and the checkpoint loads; one of another model is a 400 that changes nothing."""
        try:
            if body.abort_all_requests:  # the running requests end now, as "abort", and the update follows
                await engine_client.abort_where(None)
            await engine_client.update_weights(
                body.model_path, body.load_format or "auto", body.weight_version
            )
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "engine_unavailable") from exc
        except ValueError as exc:  # SGLang's reply, with the OpenAI error beside it
            error = {
                "message": str(exc),
                "type": "invalid_request_error",
                "param": "model_path",
                "code": None,
            }
            return JSONResponse({"success": False, "message": str(exc), "error": error}, status_code=400)
        return JSONResponse({"success": True, "message": f"now serving the weights of {body.model_path}"})

    @app.post("/abort_request")  # SGLang's
    async def abort_request(body: AbortRequest) -> Response:
        """End the request its client named `rid` (every prompt and sample of it), or every
        request with `abort_all`: each ends with finish reason "abort" and what it had generated.
        A rid that runs nowhere changes nothing."""
        if not body.abort_all and not body.rid:
            raise bad_request("give the rid a request was sent with, or abort_all true", "rid")
        try:
            await engine_client.abort_where(None if body.abort_all else rid_prefix(body.rid))
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "engine_unavailable") from exc
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            stats = await engine_client.stats()
        except EngineDeadError:  # the HTTP side's own counters still tell what happened
            stats = {"engine_faults_total": engine_client.faults}
        total = metrics if shared_metrics is None else metrics.merged(shared_metrics.peers())
        return PlainTextResponse(total.render(stats), media_type="text/plain; version=0.0.4")

    @app.post("/generate")  # SGLang's native endpoint
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await create_generation(ctx, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.resolve_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")

        messages = body.messages or []
        template = ctx.template_for(body.chat_template)
        images = await ctx.images.read(image_urls(messages), named=first_image_part(messages))

        def encode() -> bytes:  # the reply too is made off the loop: a long prompt's ids are megabytes
            ids = ids_of() if images is None else ctx.images.expand(ids_of(), images)
            counts: dict[str, Any] = {"count": len(ids), "max_model_len": engine_client.max_model_len}
            if body.return_token_strs:  # vLLM's: each id's piece, as the tokenizer spells it
                counts["token_strs"] = ctx.need_tokenizer().convert_ids_to_tokens(ids)
            tail = json.dumps(counts)
            return f'{{"tokens":[{_join_ids(ids)}],{tail[1:]}'.encode()

        def ids_of() -> list[int]:
            if body.messages is None:
                special = body.add_special_tokens is not False
                return ctx.encode(body.prompt or "", add_special_tokens=special)
            text = render_chat(
                ctx.need_tokenizer(),
                body.messages,
                template=template,
                tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                content_format=ctx.content_format,
            )
            return ctx.encode(text, add_special_tokens=bool(body.add_special_tokens))

        chars = text_chars(body.prompt if body.messages is None else body.messages)
        return Response(await ctx.off_loop(encode, chars=chars), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        ctx.resolve_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", "tokens")
        return {"prompt": await ctx.off_loop(ctx.decode, body.tokens)}

    return app


HEALTH_GENERATE_S = 20.0  # how long /health_generate waits for its token (SGLang's default)


async def _generates_one_token(ctx: ServerContext, request: Request) -> str | None:
    """None once a one-token request (not counted in the metrics) comes back from the engine
    (from each data-parallel engine), else why not: an engine failed it, refused it, or did not
    answer within HEALTH_GENERATE_S."""
    engines = len(ctx.client.handles)
    reasons = await asyncio.gather(*(_one_token_from(ctx, request, e, engines) for e in range(engines)))
    return next((r for r in reasons if r is not None), None)


async def _one_token_from(ctx: ServerContext, request: Request, engine: int, engines: int) -> str | None:
    import uuid

    from deltaserve.engine.cache.adapter import warmup_params

    which = "the engine" if engines == 1 else f"engine {engine}"
    params = warmup_params()  # one greedy token, left out of the engine's counters
    try:
        group = await ctx.submit([(f"health-{uuid.uuid4().hex}", [0], params)], track=False, engine=engine)
        await asyncio.wait_for(ctx.collect(group, request), HEALTH_GENERATE_S)
    except asyncio.TimeoutError:
        return f"{which} gave no token within {HEALTH_GENERATE_S:g} s"
    except APIError as exc:
        return exc.message
    except ClientDisconnected:
        return "the client went away"
    return None


def anthropic_model(card: ModelCard) -> dict[str, Any]:
    """A model card as Anthropic's Models API gives it (`client.models.list()` / `retrieve()`)."""
    created = datetime.fromtimestamp(card.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "type": "model",
        "id": card.id,
        "display_name": card.id,
        "created_at": created,
        "lifecycle": "active",
        "max_input_tokens": card.max_model_len,  # the context; max_tokens is what a prompt leaves of it
    }


def _join_ids(ids: list[int], piece: int = 1 << 15) -> str:
    """Token ids as JSON list items, written a piece at a time: one C call over a million ids would
    hold the GIL, and so stall the event loop's streams, for a tenth of a second."""
    return ",".join(",".join(map(str, ids[i : i + piece])) for i in range(0, len(ids), piece))


def _install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def reply(
        request: Request, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> JSONResponse:
        metrics.request_error(status)
        headers = {"Retry-After": "1"} if status == 503 else None  # full or draining: try again soon
        body = (
            anthropic_error_body(status, message)
            if anthropic_request(request.url.path, "anthropic-version" in request.headers)
            else error_body(status, message, param, code)
        )
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(request, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(InvalidParamError)
    async def invalid_param(request: Request, exc: InvalidParamError) -> JSONResponse:
        error = refused(exc)
        return reply(request, error.status, error.message, error.param, error.code)

    @app.exception_handler(QueueFullError)  # a drain's end, or a full queue, reached outside a submit
    async def engine_full(request: Request, exc: QueueFullError) -> JSONResponse:
        code = "shutting_down" if isinstance(exc, ShuttingDownError) else "queue_full"
        return reply(request, 503, str(exc), None, code)

    @app.exception_handler(EngineDeadError)  # the engine died while a call waited for it
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return reply(request, 503, str(exc), None, "engine_unavailable")

    @app.exception_handler(ClientDisconnected)  # gone while its request was prepared (a grammar's compile)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return reply(request, 400, message, param, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = _unreadable_body(exc.__cause__) or str(exc.detail)
        response = reply(request, exc.status_code, detail, None, None)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    app.add_middleware(_InternalErrors, reply=reply)


def _unreadable_body(cause: BaseException | None) -> str | None:
    """What is wrong with a JSON body the parser could not read (FastAPI says only "There was an
    error parsing the body"), or None for another failure."""
    if type(cause) is ValueError:  # int()'s limit: its own words name a Python setting
        return "request body holds an integer of more than 4,300 digits, which this server does not read"
    if isinstance(cause, RecursionError):
        return "request body nests objects and arrays deeper than this server's JSON parser follows"
    return None


class _HeadAsGet:
    """HEAD answered as GET is, headers only (FastAPI's GET routes refuse HEAD with a 405, while
    uptime checkers and some scrapers send it): a route without GET still refuses it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":  # the Content-Length of GET's body stays
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class _InternalErrors:
    """An exception no handler took becomes a 500 in the API's error shape, logged once, on a
    connection that stays open. (Starlette's handler for Exception raises again after answering,
    and uvicorn then closes the connection, often before the answer has left.)"""

    def __init__(self, app: ASGIApp, reply: Callable[..., JSONResponse]) -> None:
        self.app, self.reply = app, reply

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_started(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception:
            if started:  # part of an answer has gone: only closing the connection can tell
                raise
            logger.exception("unhandled error")  # the detail is for the log: a client learns nothing inside
            response = self.reply(Request(scope), 500, "internal error", None, "internal_error")
            await response(scope, receive, send)
