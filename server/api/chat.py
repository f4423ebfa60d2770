"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from deltaserve.engine.requests.chat_prompt import tail_tokens

from ..errors import APIError, bad_request, raise_if_failed
from ..protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    DeltaToolCall,
)
from ..text.chat_output import CallEnd, ChatOutputParser, ChatStreamState, ended_early, to_openai_tool_calls
from ..text.chat_template import (
    first_image_part,
    image_urls,
    next_turn_start,
    render_chat,
    shared_head_tokens,
)
from ..text.reasoning import prompt_opens_reasoning
from ..text.tool_calls import KIMI
from .context import ServerContext, text_chars
from .generation import Generation
from .logprobs import chat_logprobs, vllm_prompt_logprobs
from .request_params import structured_field, tool_choice_constraint, truncate_prompt

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import RequestOutput
    from deltaserve.engine.requests.sampling_params import SamplingParams, StructuredOutputs
    from deltaserve.models.vision.positions import ImageInputs

    from ..engine_client import EngineRequest


def finish_reason(reason: str | None, has_tool_calls: bool, named: bool = False) -> str | None:
    """`named`: tool_choice named the function, whose forced call ends with "stop" (OpenAI's and
    vLLM's); calls the model chose or "required" forced end with "tool_calls"."""
    return "tool_calls" if has_tool_calls and reason == "stop" and not named else reason


@dataclass
class PreparedChat:
    """A chat request made ready for the engine: its prompt, sampling parameters (with any
    grammar for JSON output or a forced tool call) and the parser of its outputs."""

    prompt_ids: list[int]
    params: SamplingParams
    parser: ChatOutputParser
    images: ImageInputs | None = None  # the prompt's, their tokens expanded in prompt_ids
    prompt: str = ""  # the rendered prompt's text (vLLM's return_prompt_text)

    def request(self, request_id: str) -> EngineRequest:
        """The engine request of one choice."""
        if self.images is None:
            return (request_id, self.prompt_ids, self.params)
        return (request_id, self.prompt_ids, self.params, self.images)


@dataclass
class _Prompt:
    """A chat request's prompt as the engine takes it, and what its rendering showed."""

    text: str
    ids: list[int]  # the images' tokens expanded
    images: ImageInputs | None
    tools: list[Any] | None  # those the template saw (none under tool_choice "none")
    forced: StructuredOutputs | None  # tool_choice's grammar
    tail: int = 0  # the prompt's last tokens that the next turn does not repeat
    shared: int = 0  # the prompt's first tokens that other conversations send too


async def _chat_prompt(
    ctx: ServerContext, req: ChatCompletionRequest, images_at: str | None, serve: bool
) -> _Prompt:
    """Render, tokenize and check the prompt (400s for a bad tool_choice or image). `serve`: it is
    to run, so an overlong text is refused before it is tokenized and the prefix cache's marks
    (tail, shared) are found; a count (count_tokens) needs neither."""
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    template = ctx.template_for(req.chat_template)

    def prepare() -> tuple[str, list[int], int, int, str]:
        text = _render(ctx, req, template, tools)
        if serve and req.truncate_prompt_tokens is None:  # a truncated prompt may be longer than the context
            ctx.refuse_overlong(text, "messages")
        ids = ctx.encode(text, add_special_tokens=req.add_special_tokens)
        tail = shared = 0
        if serve and req.add_generation_prompt and not req.continue_final_message:
            start = next_turn_start(
                ctx.need_tokenizer(),
                req.messages,
                text,
                template=template,
                tools=tools,
                template_kwargs=req.chat_template_kwargs,
                content_format=ctx.content_format,
            )
            tail = tail_tokens(ids, text, start, ctx.encode)
        if serve and not req.continue_final_message:
            shared = shared_head_tokens(
                ctx.need_tokenizer(), req.messages, ids, ctx.encode, template=template, tools=tools,
                template_kwargs=req.chat_template_kwargs, content_format=ctx.content_format,
            )  # fmt: skip
        return text, ids, tail, shared, tool_instructions(text)

    def tool_instructions(text: str) -> str:
        """The template's tool instructions, which show its tool-call form: rendered with one empty
        message, as a message quoting `<function=` in the prompt would show the other form."""
        free = req.tool_choice in (None, "auto", "none") and not any(t.function.strict for t in tools or [])
        if tools is None or free:
            return text
        try:
            return render_chat(
                ctx.need_tokenizer(),
                [ChatMessage(role="user", content="")],
                template=template,
                tools=tools,
                template_kwargs=req.chat_template_kwargs,
                content_format=ctx.content_format,
            )
        except APIError:  # a template that wants more than one message: the prompt itself
            return text

    images = await ctx.images.read(
        image_urls(req.messages), named=images_at or first_image_part(req.messages)
    )
    if images is not None and req.truncate_prompt_tokens is not None:
        raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
    text, ids, tail, shared, instructions = await ctx.off_loop(prepare, chars=text_chars(req.messages))
    ctx.images.check_placeholders(ids, len(images.grids) if images is not None else 0, "messages")
    if images is not None:
        ids = ctx.images.expand(ids, images)
    # vLLM's and OpenAI's: "required" of an empty tools list asks for no call (no tools: a 400)
    empty = req.tool_choice == "required" and req.tools == []
    forced = tool_choice_constraint(
        "none" if empty else req.tool_choice,
        tools,
        instructions,
        ctx.tool_format is KIMI,
        req.parallel_tool_calls,
    )
    return _Prompt(text, ids, images, tools, forced, tail, shared)


async def prepare_chat(
    ctx: ServerContext, req: ChatCompletionRequest, images_at: str | None = None, raw: Request | None = None
) -> PreparedChat:
    """Render and tokenize the prompt, and build what the engine and the parser need (400s for bad
    fields). Shared by chat completions, the Responses API and Anthropic's Messages API, whose
    bodies name their images elsewhere (`images_at`, a refusal's `param`). `raw`: the HTTP request,
    whose client's hanging up ends a wait for its grammar (ClientDisconnected)."""
    p = await _chat_prompt(ctx, req, images_at, serve=True)
    prompt, images, tools, forced = p.text, p.images, p.tools, p.forced
    prompt_ids = truncate_prompt(req, p.ids, ctx.client.max_model_len)
    params = ctx.sampling_params(req, len(prompt_ids), await ctx.bad_words_ids(req))
    if 0 < p.tail < len(prompt_ids):  # the prefix cache keeps the state the next turn starts from
        params = replace(params, next_turn_len=len(prompt_ids) - p.tail)
    if 0 < p.shared < len(prompt_ids) and images is None and req.truncate_prompt_tokens is None:
        # the cache keeps the state where the next conversation with this system prompt branches
        params = replace(params, shared_prefix_len=p.shared)
    # the reply is tool calls, under a grammar: any response_format is for later turns; under "auto"
    # the strict tools' grammar holds only where no response_format holds the text
    held = forced is not None and not (forced.optional_tool_calls and params.structured_outputs is not None)
    if held:
        params = replace(params, structured_outputs=forced)
    thinking = ctx.parse_reasoning and prompt_opens_reasoning(prompt)
    if thinking and params.structured_outputs is not None:
        # the model reasons freely first; the grammar holds the answer after its </think>
        params = replace(
            params, structured_outputs=replace(params.structured_outputs, after_token=ctx.think_end_id)
        )
    if params.structured_outputs is not None:
        await ctx.compile_structured(
            params.structured_outputs, "tools" if held else structured_field(req), raw
        )
    parser = ChatOutputParser(
        starts_in_reasoning=thinking,
        parse_reasoning=ctx.parse_reasoning,
        tools={t.function.name: t.function.parameters or {} for t in tools} if tools else None,
        tool_format=ctx.tool_format,
        max_calls=None if req.parallel_tool_calls else 1,
    )
    return PreparedChat(prompt_ids, params, parser, images, prompt)


def _render(ctx: ServerContext, req: ChatCompletionRequest, template: str | None, tools: Any) -> str:
    return render_chat(
        ctx.need_tokenizer(),
        req.messages,
        template=template,
        tools=tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs,
        content_format=ctx.content_format,
        documents=req.documents,
    )


async def count_chat_prompt(
    ctx: ServerContext, req: ChatCompletionRequest, images_at: str | None = None
) -> int:
    """The prompt's tokens as prepare_chat gives them to the engine, however many: a count tells
    whether a prompt fits the context, so one that does not is counted, not refused (no sampling
    parameters, no grammar; a bad tool_choice is still a 400)."""
    return len((await _chat_prompt(ctx, req, images_at, serve=False)).ids)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request) -> Response:
    ctx.force_usage(req)
    model = ctx.resolve_model(req.model)
    if req.use_beam_search:
        from .beam_search import beam_params, beam_search_chat

        params = beam_params(req, 1)  # its refusals before the prompt is rendered
        prepared = await prepare_chat(ctx, req, raw=raw)
        if prepared.images is not None:
            raise bad_request("use_beam_search does not take images", "messages")
        assert prepared.params.max_tokens is not None
        params.max_tokens = prepared.params.max_tokens  # the context's room, as chat computes it
        if prepared.params.structured_outputs is not None:  # a forced call's grammar, which no beam follows
            raise bad_request(
                "a tool_choice that forces a call is not supported with use_beam_search", "tool_choice"
            )
        return await beam_search_chat(ctx, req, raw, model, prepared, params)
    prepared = await prepare_chat(ctx, req, raw=raw)
    generation = ChatGeneration(ctx, req, model, prepared)
    generation.add(generation.request_id, prepared.prompt_ids, prepared.params, prepared.images)
    return await generation.respond(raw, req.stream)


class ChatGeneration(Generation[ChatChunkChoice]):
    """A chat completion's chunks and response: the output parsed into reasoning, content and
    tool calls."""

    chunk_type = ChatCompletionChunk
    id_prefix = "chatcmpl"

    def __init__(
        self, ctx: ServerContext, req: ChatCompletionRequest, model: str, prepared: PreparedChat
    ) -> None:
        super().__init__(ctx, model, req)
        self.req: ChatCompletionRequest = req
        self.parser = prepared.parser
        # vLLM's: with the reasoning hidden, no logprobs or token ids (they would spell it out)
        hidden = not req.include_reasoning and ctx.parse_reasoning
        self.logprobs = None if hidden else prepared.params.logprobs
        self.asked = bool(req.logprob_token_ids)  # its top logprobs are the asked ids'
        self.token_ids = req.return_token_ids and not hidden
        self.prompt_logprobs = prepared.params.prompt_logprobs  # a chat echo's too, as vLLM's
        self.prompt_text = prepared.prompt if req.return_prompt_text else None
        self.named_tool = isinstance(req.tool_choice, dict)
        self.states: dict[str, ChatStreamState] = {}

    def opening_events(self) -> list[str]:
        """As vLLM's stream opens: a chunk for each choice with its role (and the prompt's ids or
        text where asked), then, with `echo`, a chunk for each choice with the echoed text."""
        fields: dict[str, Any] = {"prompt_text": self.prompt_text}
        if self.req.return_token_ids:
            fields["prompt_token_ids"] = self.prompts[0]
        role = self.req.reply_role()
        events = [
            self.event([ChatChunkChoice(index=i, delta=ChatDelta(role=role, content=""))], **fields)
            for i in self.index.values()
        ]
        echoed = self.req.echoed()
        if echoed:
            events += [
                self.event([ChatChunkChoice(index=i, delta=ChatDelta(content=echoed))])
                for i in self.index.values()
            ]
        return events

    def delta_event(self, out: RequestOutput) -> str | None:
        parts = self._delta_parts(out)
        reasoning, content, calls, new_logprobs, reason, _ = parts
        index = self.index[out.request_id]
        if content and reasoning is None and not calls and new_logprobs is None and reason is None:
            if not self.usage_in_every_chunk and not self.token_ids:  # content alone: the common token
                return self.text_event(
                    index, content, lambda text: ChatChunkChoice(index=index, delta=ChatDelta(content=text))
                )
        choice = self._with_token_ids(self._choice(index, *parts), index, out)
        return None if choice is None else self.event([choice])

    def delta_choice(self, out: RequestOutput) -> ChatChunkChoice | None:
        index = self.index[out.request_id]
        return self._with_token_ids(self._choice(index, *self._delta_parts(out)), index, out)

    def _with_token_ids(
        self, choice: ChatChunkChoice | None, index: int, out: RequestOutput
    ) -> ChatChunkChoice | None:
        """vLLM's return_token_ids: the chunk carries the tokens it adds, those whose text the
        parser holds back (a tool call's or reasoning's markers) too. With continuous usage stats a
        step whose text is held back (by the parser, a stop string or a split character) still
        sends its chunk, an empty delta, so that the usage its tokens add is counted as they come."""
        ids = out.outputs[0].token_ids
        if not ids or not (self.token_ids or self.usage_in_every_chunk):
            return choice
        choice = choice or ChatChunkChoice(index=index, delta=ChatDelta())
        if self.token_ids:
            choice.token_ids = list(ids)
        return choice

    def _delta_parts(
        self, out: RequestOutput
    ) -> tuple[
        str | None, str | None, list[DeltaToolCall], ChatLogprobs | None, str | None, int | str | None
    ]:
        """What `out` adds: reasoning, content, tool calls, logprobs, the finish and stop reasons."""
        state = self.states.setdefault(out.request_id, ChatStreamState(self.parser))
        completion = out.outputs[0]
        cut = ended_early(completion.finish_reason)
        reasoning, content, calls = state.feed(completion.text, completion.finished(), cut)
        if not self.req.include_reasoning:
            reasoning = None
        new_logprobs = None
        if self.logprobs is not None and completion.logprobs:
            new_logprobs = chat_logprobs(completion.logprobs, self.logprobs, self.token_text, self.asked)
        return (
            reasoning,
            content,
            calls,
            new_logprobs,
            finish_reason(completion.finish_reason, state.calls_sent > 0, self.named_tool),
            completion.stop_reason if completion.finished() else None,
        )

    @staticmethod
    def _choice(
        index: int,
        reasoning: str | None,
        content: str | None,
        calls: list[DeltaToolCall],
        new_logprobs: ChatLogprobs | None,
        reason: str | None,
        stop_reason: int | str | None,
    ) -> ChatChunkChoice | None:
        if not (reasoning or content or calls or new_logprobs or reason):
            return None
        delta = ChatDelta(
            reasoning_content=reasoning, reasoning=reasoning, content=content, tool_calls=calls or None
        )
        return ChatChunkChoice(
            index=index, delta=delta, logprobs=new_logprobs, finish_reason=reason, stop_reason=stop_reason
        )

    def final_choice(self, index: int, out: RequestOutput) -> ChatChoice:
        completion = out.outputs[0]
        parsed = self.parser.parse(completion.text, final=True, cut=ended_early(completion.finish_reason))
        calls = to_openai_tool_calls(parsed.tool_calls) or None
        content: str | None = parsed.content
        if not content and (calls or parsed.reasoning):
            content = None
        reasoning = (parsed.reasoning or None) if self.req.include_reasoning else None
        echoed = self.req.echoed()
        if echoed:
            content = echoed + (content or "")
        message = AssistantMessage(
            role=self.req.reply_role(),
            content=content,
            reasoning_content=reasoning,
            reasoning=reasoning,
            tool_calls=calls,
        )
        logprobs = None
        if self.logprobs is not None:
            logprobs = chat_logprobs(completion.logprobs or [], self.logprobs, self.token_text, self.asked)
        reason = finish_reason(completion.finish_reason, bool(calls), self.named_tool)
        return ChatChoice(
            index=index,
            message=message,
            logprobs=logprobs,
            finish_reason=reason,
            stop_reason=completion.stop_reason,
            token_ids=list(completion.token_ids) if self.token_ids else None,
        )

    def response_json(self, choices: list[Any], final: dict[str, RequestOutput]) -> dict[str, Any]:
        prompt_logprobs = None
        if self.prompt_logprobs is not None:  # vLLM's: the rendered prompt's tokens, scored in its prefill
            first = final[next(iter(self.index))].prompt_logprobs
            prompt_logprobs = vllm_prompt_logprobs(first, self.prompt_logprobs, self.token_text)
        response = ChatCompletionResponse(
            id=self.response_id,
            model=self.model,
            choices=choices,
            usage=self.usage(list(final.values())),
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=self.prompts[0] if self.req.return_token_ids else None,
            prompt_text=self.prompt_text,
        )
        payload = response.model_dump(mode="json")
        if payload["prompt_logprobs"] is None:  # vLLM's field, there only when asked for
            del payload["prompt_logprobs"]
        return payload


async def parsed_steps(
    group: Any, parser: ChatOutputParser
) -> AsyncIterator[tuple[RequestOutput, str | None, list[str | DeltaToolCall | CallEnd]]]:
    """A one-choice chat request's step outputs, each with what it adds as `ChatStreamState` reads
    it (the reasoning, then content and calls in the order written); an output that failed in the
    engine raises (`raise_if_failed`). Shared by the Responses and Messages streams."""
    state = ChatStreamState(parser)
    async for outputs in group:
        for out in outputs:
            raise_if_failed(out)
            completion = out.outputs[0]
            cut = ended_early(completion.finish_reason)
            yield (out, *state.feed_in_order(completion.text, completion.finished(), cut))


class PartsWriter:
    """A reply written from a chat stream's parsed parts (the Responses and Messages APIs' event
    builders): `feed` sends a step's reasoning, then its content and calls in written order, to
    `text` (with the API's name for each kind of text), `call` (a call's name, once known),
    `arguments` (a fragment of the open call's) and `call_end` (the model ended the call)."""

    reasoning_kind: str  # the API's name for reasoning text
    content_kind: str  # ... and for the answer's text
    last: RequestOutput | None = None  # after `write`: the request's final output

    async def write(self, group: Any, parser: ChatOutputParser) -> AsyncIterator[str]:
        """The events of each step's parts (`parsed_steps`; a failed output raises)."""
        async for out, reasoning, ordered in parsed_steps(group, parser):
            opening = self.opening(out) if self.last is None else []
            self.last = out
            self.step(out)
            for event in opening + self.feed(reasoning, ordered):
                yield event

    def opening(self, first: RequestOutput | None) -> list[str]:
        """The events before the reply's first parts, once `first` (the request's first output,
        None where it failed) is read: none unless the API's writer sends some."""
        return []

    def step(self, out: RequestOutput) -> None:
        """Read a step's output before its parts are fed: nothing unless the API's writer needs it."""

    def feed(self, reasoning: str | None, ordered: list[str | DeltaToolCall | CallEnd]) -> list[str]:
        events = self.text(self.reasoning_kind, reasoning) if reasoning else []
        for part in ordered:
            if isinstance(part, str):
                events += self.text(self.content_kind, part)
            elif isinstance(part, CallEnd):
                events += self.call_end()
            else:
                if part.function.name is not None:
                    events += self.call(part.function.name, part.id)
                if part.function.arguments:
                    events += self.arguments(part.function.arguments)
        return events

    def text(self, kind: str, piece: str) -> list[str]:
        raise NotImplementedError

    def call(self, name: str, call_id: str | None = None) -> list[str]:
        """A call begins. `call_id`: its id in the chat reply (the model's own where it writes one)."""
        raise NotImplementedError

    def arguments(self, piece: str) -> list[str]:
        raise NotImplementedError

    def call_end(self) -> list[str]:
        raise NotImplementedError
