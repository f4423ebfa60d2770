"""POST /generate: SGLang's native endpoint, so that SGLang users' scripts and its load generator
(`sglang.bench_serving --backend sglang`) run unchanged.

A request holds one prompt or a batch (`text`, or `input_ids`) and SGLang's `sampling_params`
(one dict, or one a prompt). Each prompt's parameters become a completion request's
(`max_new_tokens` its `max_tokens`, `min_new_tokens` its `min_tokens`, `json_schema` / `regex` /
`ebnf` its structured outputs, ...), so the values, their ranges and the generation defaults are
the completions endpoint's. The reply is SGLang's: `{"text", "output_ids", "meta_info": {"id",
"finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", ...}}` for one prompt and
one sample, else a list of them (prompt by prompt, each prompt's `n` samples together); a stream
sends the same objects, text and token ids so far, as server-sent events ending in `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from deltaserve.engine.requests.sampling_params import MAX_LOGPROB_TOKEN_IDS, MAX_PROMPT_LOGPROB_TOKEN_IDS

from ..errors import APIError, bad_request, failure_body, quoted, raise_if_failed
from ..protocol import ClientName, CompletionRequest, RequestBody, unsupported_if_set, validated
from .context import ServerContext
from .generation import DONE, sse
from .json_body import Encoded, EncodedResponse, encode, encoded_list
from .request_params import fan_out, rid_prefix

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import Logprob, RequestOutput
    from deltaserve.engine.requests.sampling_params import SamplingParams

    from ..engine_client import EngineRequest

# SGLang's sampling parameter -> the completion request's field
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
    "thinking_budget": "thinking_token_budget",  # the name of SGLang's thinking-budget change
}
_SAME = {
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "n", "logit_bias",
}  # fmt: skip
_STRUCTURED = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
_IGNORED = {"spaces_between_special_tokens"}  # deltaserve's detokenizer joins special tokens as decode does
_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's


def _unsupported(why: str) -> Any:
    return unsupported_if_set(f"not supported: {why}")


class GenerateRequest(RequestBody):
    unsupported = {
        "input_embeds": _unsupported("send text or input_ids"),
        "audio_data": _unsupported("this server reads no audio"),
        "video_data": _unsupported("this server reads no videos"),
        "lora_path": _unsupported("this server serves no LoRA adapters"),
        "custom_logit_processor": _unsupported("this server runs no custom logit processors"),
        "return_hidden_states": _unsupported("this server returns no hidden states"),
    }
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # a prompt's images (a data: URL, an http(s): URL or base64 data), one list a prompt in a batch;
    # the prompt holds one placeholder an image, as the chat template writes them
    image_data: str | list[str | list[str] | None] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: ClientName | list[ClientName] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    # these tokens' log-probabilities at every position scored (one list, or one a prompt)
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: int = 0  # SGLang's and vLLM's: with --scheduling-policy priority, lower values run first


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise bad_request(f"{name} has {len(value)} entries for {count} prompts", name)
    return value


def _completion_request(
    sampling: dict[str, Any], logprobs: int | None, start: int, priority: int
) -> CompletionRequest:
    """SGLang's sampling parameters as an unstreamed completion request's fields (400s name
    SGLang's field); a stream's output kind is set on the engine parameters after."""
    fields: dict[str, Any] = {"prompt": [0], "max_tokens": _DEFAULT_MAX_NEW_TOKENS, "priority": priority}
    structured: dict[str, Any] = {}
    for key, value in sampling.items():
        if key in _RENAMED:
            fields[_RENAMED[key]] = value
        elif key in _SAME:
            fields[key] = value
        elif key in _STRUCTURED:
            if value is not None:
                structured[_STRUCTURED[key]] = value
        elif key not in _IGNORED:
            raise bad_request(
                f"sampling_params: {key!r} is not a sampling parameter this server takes",
                f"sampling_params.{key}",
            )
    if len(structured) > 1:
        raise bad_request("sampling_params: give one of json_schema, regex and ebnf", "sampling_params")
    if structured:
        fields["structured_outputs"] = structured
    if logprobs is not None:
        fields["logprobs"] = logprobs
    if start >= 0:
        fields["prompt_logprobs"] = logprobs or 0
    return validated(CompletionRequest, fields)


_NAMES = {ours: f"sampling_params.{theirs}" for theirs, ours in _RENAMED.items()}
_NAMES.update(logprobs="top_logprobs_num", prompt_logprobs="top_logprobs_num")  # the count of each kind
# json_schema, regex or ebnf: named as when their grammar fails to compile
_NAMES["structured_outputs"] = "sampling_params"


def _image_urls(data: str | list[Any] | None, count: int, single: bool) -> list[list[str]]:
    """Each prompt's images: one prompt takes a string or a list of them, a batch one entry a
    prompt (a string, a list of them, or null)."""
    if data is None:
        return [[] for _ in range(count)]
    if isinstance(data, str):
        data = [data]
    if single and all(isinstance(d, str) for d in data):
        data = [data]  # one prompt's images
    urls = [
        [] if p is None else [p] if isinstance(p, str) else p for p in _per_prompt(data, count, "image_data")
    ]
    if any(not isinstance(u, str) for p in urls for u in p):
        raise bad_request("image_data holds a string an image, a list of them a prompt", "image_data")
    return urls


class _Prompt:
    """One prompt of the request: its ids, what it asks for, and its samples' engine requests."""

    def __init__(self, rid: str, ids: list[int], params: SamplingParams, logprobs: bool, start: int) -> None:
        self.rid, self.ids, self.params = rid, ids, params
        self.logprobs, self.start = logprobs, start
        # its input_* logprob fields, encoded, by (the scored rows' id, strict)
        self.input_logprobs: dict[tuple[int, bool], tuple[Any, dict[str, Encoded]]] = {}


class NativeGeneration:
    def __init__(self, ctx: ServerContext, body: GenerateRequest) -> None:
        self.ctx, self.body = ctx, body
        self.created = time.time()
        self.requests: list[EngineRequest] = []
        self.owner: dict[str, _Prompt] = {}  # engine request id -> its prompt
        self.order: list[str] = []  # engine request ids, in the reply's order
        self.index: dict[str, int] = {}  # ... and each one's place there
        self.single = False

    async def prepare(self, raw: Request | None = None) -> None:
        body, ctx = self.body, self.ctx
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("give one of text and input_ids", "text")
        batch: list[list[int]]
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else body.text
            for t in texts:  # all before any is tokenized
                ctx.refuse_overlong(t, "text")
            batch = [await ctx.off_loop(ctx.encode, t, chars=len(t)) for t in texts]
            self.single = isinstance(body.text, str)
        else:
            ids = body.input_ids or []
            self.single = not ids or isinstance(ids[0], int)
            batch = [ids] if self.single else ids  # type: ignore[list-item,assignment]
        if not batch or any(not ids for ids in batch):
            raise bad_request("the prompt is empty", "text" if body.text is not None else "input_ids")
        for ids in batch:  # before the vocabulary scan, on the event loop
            ctx.refuse_overlong_ids(ids, "text" if body.text is not None else "input_ids")
        for ids in batch:
            bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
            if bad:
                raise bad_request(
                    f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", "input_ids"
                )
        count = len(batch)
        given = {} if body.sampling_params is None else body.sampling_params  # [] is no entry, not {}
        samplings = _per_prompt(given, count, "sampling_params")
        rids = _per_prompt(body.rid, count, "rid") if body.rid is not None else [None] * count
        named = [r for r in rids if r is not None]
        if len(set(named)) < len(named):  # one name, two prompts: their replies and aborts would mix
            twice = next(r for r in named if named.count(r) > 1)
            raise bad_request(f"rid {quoted(twice)} names more than one prompt; give each its own", "rid")
        wants = _per_prompt(body.return_logprob, count, "return_logprob")
        starts = _per_prompt(body.logprob_start_len, count, "logprob_start_len")
        tops = _per_prompt(body.top_logprobs_num, count, "top_logprobs_num")
        images = _image_urls(body.image_data, count, self.single)
        asked = body.token_ids_logprob
        if asked and isinstance(asked[0], int):
            asked = [asked] * count  # type: ignore[list-item]
        asks = _per_prompt(asked, count, "token_ids_logprob") if asked is not None else [None] * count
        for ask, want, start in zip(asks, wants, starts):
            # each scored prompt position reports them too: fewer where the prompt is scored
            most = MAX_PROMPT_LOGPROB_TOKEN_IDS if want and start >= 0 else MAX_LOGPROB_TOKEN_IDS
            if len(ask or []) > most:
                raise bad_request(
                    f"token_ids_logprob holds at most {most} token ids a prompt"
                    + (" whose prompt is scored (logprob_start_len)" if most < MAX_LOGPROB_TOKEN_IDS else ""),
                    "token_ids_logprob",
                )
            bad = [t for t in ask or [] if not 0 <= t < ctx.vocab_size]
            if bad:
                raise bad_request(
                    f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", "token_ids_logprob"
                )
        built: set[int] = set()  # the sampling_params objects built so far (one may serve the batch)
        for ids, sampling, rid, want, start, top, urls, ask in zip(
            batch, samplings, rids, wants, starts, tops, images, asks
        ):
            if not isinstance(sampling, dict):
                raise bad_request("sampling_params must be an object, or a list of them", "sampling_params")
            await asyncio.sleep(0)  # a batch's prompts one by one, other requests served between them
            read = await ctx.images.read(urls, "image_data")
            if read is not None:
                ids = ctx.images.expand(ids, read, "image_data")
            else:  # a placeholder goes with an image of image_data
                ctx.images.check_placeholders(ids, 0, "text" if body.text is not None else "input_ids")
            if start < -1 or want and start >= len(ids):
                raise bad_request(
                    f"logprob_start_len must be -1 (none of the prompt) or a position in the prompt's "
                    f"{len(ids)} tokens (0 to {len(ids) - 1}), got {start}",
                    "logprob_start_len",
                )
            start = start if want else -1
            try:
                creq = _completion_request(sampling, top if want else None, start, body.priority)
                # a batch's shared sampling_params: the log warns of a low temperature once
                # SGLang reads temperature 0 as top_k 1 and serves n copies of it
                params = ctx.sampling_params(
                    creq, len(ids), warn=id(sampling) not in built, greedy_copies=True
                )
                built.add(id(sampling))
            except APIError as exc:
                raise exc.renamed(_NAMES) from exc
            if body.stream:  # each event is the whole result so far, the prompt's logprobs too
                params = dataclasses.replace(params, output_kind="delta")
            if ask:
                if not want:
                    raise bad_request("token_ids_logprob needs return_logprob", "token_ids_logprob")
                # SGLang's: the ids at the scored prompt positions and at the output's alike
                scored = list(dict.fromkeys(ask)) if params.prompt_logprobs is not None else None
                params = dataclasses.replace(
                    params, logprob_token_ids=list(ask), prompt_logprob_token_ids=scored
                )
            prompt = _Prompt(rid or uuid.uuid4().hex, ids, params, bool(want), start)
            if params.structured_outputs is not None:
                await ctx.compile_structured(params.structured_outputs, "sampling_params", raw)
            base = f"{rid_prefix(rid) if rid else 'generate-'}{uuid.uuid4().hex}"
            for request in fan_out(base, ids, params, read):
                self.requests.append(request)
                self.owner[request[0]] = prompt
                self.index[request[0]] = len(self.order)
                self.order.append(request[0])
        self.single = self.single and len(self.order) == 1

    async def respond(self, raw: Request) -> Response:
        n = max(p.params.n for p in self.owner.values())
        prompts = [p.ids for p in {id(p): p for p in self.owner.values()}.values()]
        try:
            return await self.ctx.run(
                self.requests, raw, self.body.stream, self._events, self._answer, prompts, n
            )
        except APIError as exc:  # a batch too large to admit names the prompts by their field here
            raise exc.renamed({"prompt": "text" if self.body.text is not None else "input_ids"}) from exc

    async def _answer(self, final: dict[str, RequestOutput]) -> Response:
        """The reply, result by result with the event loop serving other requests between them."""
        results = []
        for rid in self.order:
            out = final[rid]
            c = out.outputs[0]
            results.append(encode(self._result(out, c.text, c.token_ids, c.logprobs, out.prompt_logprobs)))
            await asyncio.sleep(0)
        return EncodedResponse(results[0] if self.single else encoded_list(results))

    async def _events(self, group: Any) -> Any:
        texts = dict.fromkeys(self.order, "")
        ids: dict[str, list[int]] = {rid: [] for rid in self.order}
        lps: dict[str, list[Logprob]] = {rid: [] for rid in self.order}
        prompt_lps: dict[str, Any] = {}
        try:
            async for outputs in group:
                for i, out in enumerate(outputs):
                    if i:  # one step's outputs of many samples: other requests are served between them
                        await asyncio.sleep(0)
                    raise_if_failed(out)
                    rid, c = out.request_id, out.outputs[0]
                    texts[rid] += c.text
                    ids[rid] += c.token_ids
                    lps[rid] += c.logprobs or []
                    if out.prompt_logprobs is not None:
                        prompt_lps[rid] = out.prompt_logprobs
                    event = self._result(
                        out, texts[rid], ids[rid], lps[rid], prompt_lps.get(rid), strict=False
                    )
                    if not self.single:
                        event["index"] = self.index[rid]
                    yield sse(event)
        except Exception as exc:  # the engine failed or the server is draining: say so in-band
            yield sse(failure_body(exc))
        yield DONE

    def _result(
        self,
        out: RequestOutput,
        text: str,
        token_ids: list[int],
        logprobs: list[Logprob] | None,
        prompt_logprobs: list[Logprob | None] | None,
        strict: bool = True,
    ) -> dict[str, Any]:
        """One sample's result; `strict`: its prompt's logprobs encoded as a reply's (else as an
        event's), once for every sample and event of the prompt."""
        prompt = self.owner[out.request_id]
        c = out.outputs[0]
        meta: dict[str, Any] = {
            "id": prompt.rid
            if self.single or prompt.params.n == 1
            else f"{prompt.rid}-{out.request_id.rsplit('-', 1)[1]}",
            "finish_reason": _finish_reason(c.finish_reason, c.stop_reason, c.num_tokens, token_ids),
            "prompt_tokens": len(prompt.ids),
            "completion_tokens": c.num_tokens,
            "cached_tokens": out.num_cached_tokens,
        }
        if c.finish_reason is not None:
            meta["e2e_latency"] = time.time() - self.created
        if prompt.logprobs:
            with_text = self.body.return_text_in_logprobs
            meta["output_token_logprobs"] = [
                self._entry(lp.logprob, lp.token_id, with_text) for lp in logprobs or []
            ]
            if prompt.params.logprobs:
                meta["output_top_logprobs"] = [self._top(lp.top, with_text) for lp in logprobs or []]
            if prompt.params.logprob_token_ids:
                meta["output_token_ids_logprobs"] = [
                    self._asked(lp.asked, with_text) for lp in logprobs or []
                ]
            if prompt.start >= 0:
                meta.update(self._input_logprobs(prompt, prompt_logprobs, strict))
        return {"text": text, "output_ids": list(token_ids), "meta_info": meta}

    def _input_logprobs(
        self, prompt: _Prompt, scored: list[Logprob | None] | None, strict: bool
    ) -> dict[str, Encoded]:
        """The prompt's input_* logprob fields from `logprob_start_len` on, encoded once for all
        the samples (and events) that share its scored rows."""
        key = (id(scored), strict)
        hit = prompt.input_logprobs.get(key)
        if hit is not None:
            return hit[1]
        with_text = self.body.return_text_in_logprobs
        rows = list(scored or [])[prompt.start :]
        tokens = prompt.ids[prompt.start :]
        fields: dict[str, Any] = {
            "input_token_logprobs": [
                self._entry(None if lp is None else lp.logprob, t, with_text) for lp, t in zip(rows, tokens)
            ]
        }
        if prompt.params.logprobs:
            fields["input_top_logprobs"] = [
                None if lp is None else self._top(lp.top, with_text) for lp in rows
            ]
        if prompt.params.prompt_logprob_token_ids:
            fields["input_token_ids_logprobs"] = [
                None if lp is None else self._asked(lp.asked, with_text) for lp in rows
            ]
        encoded = {name: encode(value, strict) for name, value in fields.items()}
        prompt.input_logprobs[key] = (scored, encoded)  # the rows kept: their id stays theirs
        return encoded

    def _entry(self, logprob: float | None, token_id: int, with_text: bool) -> list[Any]:
        return [logprob, token_id, self.ctx.token_text(token_id)[0] if with_text else None]

    def _asked(self, asked: dict[int, float], with_text: bool) -> list[list[Any]]:
        return [self._entry(lp, t, with_text) for t, lp in asked.items()]

    def _top(self, top: dict[int, float], with_text: bool) -> list[list[Any]]:
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        return [self._entry(lp, t, with_text) for t, lp in ranked]


def _finish_reason(
    reason: str | None, stop_reason: int | str | None, tokens: int, token_ids: list[int]
) -> dict[str, Any] | None:
    """SGLang's shape: {"type": "stop", "matched": token id or string}, {"type": "length",
    "length": n} or {"type": "abort"}. A stop with no reason recorded (a grammar that ended on its
    stop token) matched the last token."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": tokens}
    if reason == "stop":
        return {
            "type": "stop",
            "matched": stop_reason if stop_reason is not None or not token_ids else token_ids[-1],
        }
    return {"type": "abort", "message": "the request was aborted"}


async def create_generation(ctx: ServerContext, body: GenerateRequest, raw: Request) -> Response:
    generation = NativeGeneration(ctx, body)
    await generation.prepare(raw)
    return await generation.respond(raw)
