"""SGLang's POST /abort_request on a real server (built-in model): a /generate request ended by its
`rid`, beside one whose rid it starts, and every request with `abort_all`; each ends with finish
reason "abort" (a response cancelled, a message with no stop reason) and what it had generated,
frees its slot, and the server serves on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

# Long generations held running until they are aborted
pytestmark = pytest.mark.slow

LONG = {"temperature": 0, "max_new_tokens": 480, "ignore_eos": True}


def stream_generate(url: str, body: dict[str, Any], out: dict[str, Any], started: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=120) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    out["last"] = json.loads(events[-2])  # the one before [DONE]


def running(url: str, bodies: list[dict[str, Any]]) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    outs: list[dict[str, Any]] = [{} for _ in bodies]
    threads = []
    for body, out in zip(bodies, outs):
        started = threading.Event()
        thread = threading.Thread(target=stream_generate, args=(url, body, out, started))
        thread.start()
        assert started.wait(60)  # its first chunk came: it runs
        threads.append(thread)
    return threads, outs


def test_a_rid_ends_that_request_and_no_other(server, until_idle) -> None:
    threads, outs = running(
        server.url,
        [
            {"input_ids": [5, 9, 17], "sampling_params": LONG, "rid": "job-1"},
            {"input_ids": [5, 9, 17], "sampling_params": LONG, "rid": "job-1-b"},  # job-1's rid starts it
        ],
    )
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "job-1"}).status_code == 200
    for t in threads:
        t.join(120)
    aborted, whole = (o["last"]["meta_info"] for o in outs)
    assert aborted["id"] == "job-1" and aborted["finish_reason"]["type"] == "abort"
    assert 0 < aborted["completion_tokens"] < 480
    assert whole["finish_reason"] == {"type": "length", "length": 480}
    assert until_idle(server.url)["deltaserve_state_slots_used"] == 0


def until_metric(url: str, read_metrics: Callable[[str], dict[str, float]], name: str, least: float) -> None:
    """Wait until the server's metric `name` is at least `least` (what was sent has reached the engine)."""
    deadline = time.monotonic() + 60
    while read_metrics(url)[name] < least:
        assert time.monotonic() < deadline, f"{name} stayed under {least}"
        time.sleep(0.05)


def test_abort_all_ends_every_request_and_the_server_serves_on(server, until_idle, read_metrics) -> None:
    threads, outs = running(server.url, [{"input_ids": [7, 8], "sampling_params": LONG}])
    completion: dict[str, Any] = {}

    def complete() -> None:
        body = {"model": MODEL_NAME, "prompt": "go on", "max_tokens": 480, "ignore_eos": True}
        completion.update(httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json())

    other = threading.Thread(target=complete)
    other.start()
    until_metric(server.url, read_metrics, "deltaserve_num_requests_running", 2)  # the completion runs too
    assert httpx.post(f"{server.url}/abort_request", json={"abort_all": True}).status_code == 200
    for t in [*threads, other]:
        t.join(120)
    assert outs[0]["last"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert completion["choices"][0]["finish_reason"] == "abort"
    assert completion["usage"]["completion_tokens"] < 480
    assert until_idle(server.url)["deltaserve_state_slots_used"] == 0
    after = httpx.post(
        f"{server.url}/generate", json={"input_ids": [7, 8], "sampling_params": {**LONG, "max_new_tokens": 4}}
    )
    assert after.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_a_rid_that_runs_nowhere_changes_nothing_and_no_rid_is_a_400(server) -> None:
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "never-sent"}).status_code == 200
    bad = httpx.post(f"{server.url}/abort_request", json={})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"


def test_an_openai_request_named_by_the_client_is_aborted_by_that_name(server, until_idle) -> None:
    """vLLM's request_id (or X-Request-Id) and SGLang's rid on the OpenAI endpoints name the request
    for /abort_request too; the reply's id carries the name."""
    results: dict[str, Any] = {}
    started = {name: threading.Event() for name in ("body", "header", "sglang", "other")}

    def chat(name: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        payload = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 480,
            "ignore_eos": True,
            "stream": True,
            **body,
        }
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=payload, headers=headers, timeout=120
        ) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    started[name].set()
        results[name] = events

    threads = [
        threading.Thread(target=chat, args=("body", {"request_id": "chat-7"}, {})),
        threading.Thread(target=chat, args=("header", {}, {"X-Request-Id": "hdr-9"})),
        threading.Thread(target=chat, args=("sglang", {"rid": "sg-3"}, {})),
        threading.Thread(target=chat, args=("other", {"request_id": "chat-70"}, {})),
    ]
    for t in threads:
        t.start()
    assert all(event.wait(60) for event in started.values())  # all four stream
    for name in ("chat-7", "hdr-9", "sg-3"):
        assert httpx.post(f"{server.url}/abort_request", json={"rid": name}).status_code == 200
    for t in threads:
        t.join(120)
    finish = {
        k: [c["finish_reason"] for e in v for c in e["choices"] if c["finish_reason"]]
        for k, v in results.items()
    }
    assert finish == {"body": ["abort"], "header": ["abort"], "sglang": ["abort"], "other": ["length"]}
    assert results["body"][0]["id"] == "chatcmpl-chat-7" and results["header"][0]["id"] == "chatcmpl-hdr-9"
    assert until_idle(server.url)["deltaserve_state_slots_used"] == 0


def test_a_beam_search_is_aborted_by_its_name(server, until_idle, read_metrics) -> None:
    """A beam search named by the client: its steps run under that name, so /abort_request ends
    it; the reply (not a 500) holds the beams as they were, finish reason "abort"."""
    reply: dict[str, Any] = {}
    body = {"model": MODEL_NAME, "prompt": "go", "n": 2, "use_beam_search": True, "max_tokens": 400,
            "ignore_eos": True, "request_id": "beams-1"}  # fmt: skip

    def search() -> None:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        reply.update(status=r.status_code, body=r.json())

    prompted = read_metrics(server.url)["deltaserve_prompt_tokens_total"]
    thread = threading.Thread(target=search)
    thread.start()
    # its first step is in (it counts the prompt's tokens): it has arrived, so the abort ends it
    until_metric(server.url, read_metrics, "deltaserve_prompt_tokens_total", prompted + 1)
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "beams-1"}).status_code == 200
    thread.join(120)
    assert reply["status"] == 200, reply
    assert reply["body"]["id"] == "cmpl-beams-1"
    assert [c["finish_reason"] for c in reply["body"]["choices"]] == ["abort", "abort"]
    assert reply["body"]["usage"]["completion_tokens"] < 2 * 400
    assert until_idle(server.url)["deltaserve_state_slots_used"] == 0


def abort_named_while_they_run(
    url: str, sends: dict[str, Callable[[threading.Event | None], Any]], streamed: set[str]
) -> dict[str, Any]:
    """Run each of `sends` (named by its key, its X-Request-Id) in a thread, abort each by its name
    once the `streamed` ones write (each sets the event it is given; the others get None), and
    return their results."""
    results: dict[str, Any] = {}
    started = {name: threading.Event() for name in streamed}

    def run(name: str) -> None:
        results[name] = sends[name](started.get(name))

    threads = [threading.Thread(target=run, args=(name,)) for name in sends]
    for t in threads:
        t.start()
    assert all(event.wait(60) for event in started.values())  # the streams run, and so the others
    for name in sends:
        assert httpx.post(f"{url}/abort_request", json={"rid": name}).status_code == 200
    for t in threads:
        t.join(120)
    assert set(results) == set(sends)
    return results


def test_a_response_aborted_while_it_runs_is_cancelled(server, client, until_idle) -> None:
    """The Responses API has no name field; its X-Request-Id header names the request for
    /abort_request, as on chat. An aborted response says so, streamed or not, as OpenAI's SDK reads
    it: `status` `cancelled`, the item it cut `incomplete`, and a stream's last event
    `response.incomplete`, not `response.completed`."""

    def respond(name: str, stream: bool) -> Callable[[threading.Event | None], Any]:
        kw: dict[str, Any] = dict(
            model=MODEL_NAME,
            input="hi",
            max_output_tokens=480,
            temperature=0,
            extra_headers={"X-Request-Id": name},
            extra_body={"ignore_eos": True},
        )

        def send(started: threading.Event | None) -> Any:
            if started is None:
                return client.responses.create(**kw)
            events = []
            for event in client.responses.create(**kw, stream=True):
                events.append(event)
                if event.type.endswith(".delta"):  # the engine writes it
                    started.set()
            return events

        return send

    sends = {"resp-whole": respond("resp-whole", False), "resp-stream": respond("resp-stream", True)}
    results = abort_named_while_they_run(server.url, sends, {"resp-stream"})
    whole = results["resp-whole"]
    assert whole.status == "cancelled" and whole.incomplete_details is None
    assert 0 < whole.usage.output_tokens < 480
    assert whole.output[-1].status == "incomplete"  # the item being written when it was aborted
    assert client.responses.retrieve(whole.id).status == "cancelled"  # stored as it ended
    events = results["resp-stream"]
    for event in events:  # every event, the last one's cancelled response too, is OpenAI's shape
        TypeAdapter(ResponseStreamEvent).validate_python(event.to_dict())
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    last = events[-1].response
    assert last.status == "cancelled" and 0 < last.usage.output_tokens < 480
    assert last.output[-1].status == "incomplete"
    assert until_idle(server.url)["deltaserve_state_slots_used"] == 0
    assert until_idle(server.url)["deltaserve_kv_pages_used"] == 0


def test_a_message_aborted_while_it_runs_has_no_stop_reason(server, until_idle) -> None:
    """The Messages API has no name field either: X-Request-Id names it. An aborted message's
    stop_reason is null (as vLLM's), streamed or not, as Anthropic's SDK reads it: not `end_turn`,
    which would pass the cut reply off as the whole one."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)

    def message(name: str) -> Callable[[threading.Event | None], Any]:
        kw: dict[str, Any] = dict(
            model=MODEL_NAME,
            max_tokens=480,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Request-Id": name},
            extra_body={"ignore_eos": True, "temperature": 0},  # newer SDKs no longer send temperature
        )

        def send(started: threading.Event | None) -> Any:
            if started is None:
                return claude.messages.create(**kw)
            ends = []  # the stream's message_delta stop reasons
            with claude.messages.stream(**kw) as events:
                for event in events:
                    if event.type == "content_block_delta":  # the engine writes it
                        started.set()
                    if event.type == "message_delta":
                        ends.append(event.delta.stop_reason)
                return events.get_final_message(), ends

        return send

    sends = {"msg-whole": message("msg-whole"), "msg-stream": message("msg-stream")}
    with claude:
        results = abort_named_while_they_run(server.url, sends, {"msg-stream"})
    streamed, ends = results["msg-stream"]
    assert ends == [None]  # one message_delta, its stop_reason null
    for reply in (results["msg-whole"], streamed):
        assert reply.stop_reason is None and reply.stop_sequence is None, reply.id
        assert 0 < reply.usage.output_tokens < 480
    assert until_idle(server.url)["deltaserve_state_slots_used"] == 0
    assert until_idle(server.url)["deltaserve_kv_pages_used"] == 0


def test_a_request_named_while_its_prompt_waits_is_aborted_once_added(
    server, until_idle, post_with_continue
) -> None:
    """An /abort_request that names a request while its prompt waits to be tokenized (behind a long
    prompt in the one long-text worker) ends it once it reaches the engine, with finish reason
    "abort", as a running request would end: it does not run to its length."""
    replies: dict[str, Any] = {}

    def complete(name: str, body: dict[str, Any], headers: dict[str, str], read: threading.Event) -> None:
        status, reply = post_with_continue(
            server.port, "/v1/completions", {"model": MODEL_NAME, **body}, headers, read
        )
        replies[name] = (time.monotonic(), status, reply)

    # 4.8 MB, tokenized whole (truncate_prompt_tokens spares it the length bound's early 400)
    long_prompt = {
        "prompt": "hello world, this is some text. " * 150_000,
        "max_tokens": 1,
        "truncate_prompt_tokens": 8,
    }
    # over a megabyte too: it waits for the long-text worker, where a short prompt would not wait
    named = {
        "prompt": "go on. " * 160_000,
        "truncate_prompt_tokens": 8,
        "max_tokens": 480,
        "ignore_eos": True,
    }
    long_read, named_read = threading.Event(), threading.Event()
    blocker = threading.Thread(target=complete, args=("long", long_prompt, {}, long_read))
    waiting = threading.Thread(target=complete, args=("named", named, {"X-Request-Id": "late-1"}, named_read))
    blocker.start()
    assert long_read.wait(60)  # its prompt is on its way to the long-text worker
    waiting.start()
    assert named_read.wait(60)  # arrived, so an abort from now on names it, its prompt behind the long one
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "late-1"}).status_code == 200
    aborted_at = time.monotonic()
    blocker.join(300)
    waiting.join(300)
    done_at, status, body = replies["long"]
    assert status == 200 and done_at > aborted_at  # still tokenizing when the abort came
    _, status, body = replies["named"]
    assert status == 200 and body["id"] == "cmpl-late-1"
    assert body["choices"][0]["finish_reason"] == "abort" and body["usage"]["completion_tokens"] < 480
    assert until_idle(server.url)["deltaserve_state_slots_used"] == 0
