"""One bad request never hurts anyone else: hostile inputs are 4xx OpenAI errors that keep the
connection, the body's size and the API key are checked before the body is read, a burst fills
the running batch and the waiting queue before anything is refused, a request the engine fails
ends alone with an error, and nothing leaks."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import httpx
import pytest

from deltaserve.engine.requests.outputs import CompletionOutput, RequestOutput
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

from .conftest import app_in_thread

NAN, INF = float("nan"), float("inf")
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2}
KEY = "sekrit"
LIMIT = 32 * 1024 * 1024  # the default body limit


def error_of(status: int, body: bytes) -> dict:
    """The OpenAI error object of an error reply (asserting its shape)."""
    assert status >= 400, (status, body[:500])
    payload = json.loads(body)
    assert set(payload) == {"error"}
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def called(arguments: str) -> dict:
    """An assistant turn that called f with these arguments."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "tool_calls": [call]}


HOSTILE = [
    # token ids the sampler would index with
    ("/v1/completions", {**COMPLETION, "min_tokens": 1, "stop_token_ids": [999999999]}, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 1, "stop_token_ids": [2**70]}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 1, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(2**70): 1}}, "logit_bias"),
    # keys Python's int() reads but that are not token ids ("5_0" would bias token 50)
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5_0": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {" 5": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 1, "05": -1}}, "logit_bias"),
    ("/v1/responses", {**RESPONSE, "logit_bias": {"+5": 1}}, "logit_bias"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"\u0665": 1}}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": NAN}}, "logit_bias.5"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [2**70]]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [-5]}, "prompt"),
    ("/detokenize", {"tokens": [2**70]}, "tokens"),
    ("/v1/completions", {**COMPLETION, "seed": 2**70}, "seed"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 2**70}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**70}, "max_tokens"),
    # lists every running copy searches at every step: bounded (100,000 stop strings slowed
    # every other request's steps 20x)
    ("/v1/completions", {**COMPLETION, "stop": [f"zq{i}" for i in range(65)]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a" * 1025]}, "stop"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [7] * 1025}}, "stop_token_ids"),
    ("/v1/responses", {**RESPONSE, "bad_words": [f"zq{i}" for i in range(65)]}, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(i): -100 for i in range(1025)}}, "logit_bias"),
    # NaN and infinities, in typed and in free-form fields
    ("/v1/chat/completions", {**CHAT, "temperature": NAN}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": INF}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "min_p": NAN}, "min_p"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": -INF}, "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "frequency_penalty": NAN}, "frequency_penalty"),
    ("/v1/completions", {**COMPLETION, "repetition_penalty": INF}, "repetition_penalty"),
    ("/v1/completions", {**COMPLETION, "temperature": INF}, "temperature"),
    ("/v1/responses", {**RESPONSE, "temperature": NAN}, "temperature"),
    ("/v1/responses", {**RESPONSE, "top_p": NAN}, "top_p"),
    ("/v1/responses", {**RESPONSE, "metadata": {"x": INF}}, "metadata.x"),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "x": NAN}},
        "response_format.x",
    ),
    # lone surrogates in every kind of text
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]},
        "messages.0.content",
    ),
    ("/v1/chat/completions", {**CHAT, "stop": ["ok", "\udfff"]}, "stop.1"),
    ("/v1/chat/completions", {**CHAT, "model": "\ud800"}, "model"),
    ("/v1/completions", {**COMPLETION, "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["fine", "a\udc00"]}, "prompt.1"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"\ud800": 1}}, "logit_bias"),
    ("/v1/responses", {**RESPONSE, "input": "a\ud800b"}, "input"),
    ("/v1/responses", {**RESPONSE, "input": [{"role": "user", "content": "\ud800"}]}, "input.0.content"),
    ("/v1/responses", {**RESPONSE, "instructions": "\udbff"}, "instructions"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    # an earlier call's arguments (a JSON string, so past the body's checks) that Python's json
    # reads but no prompt holds: a lone surrogate escape, an integer past int()'s 4300 digits
    *(
        (
            path,
            {**body, "messages": [{"role": "user", "content": "hi"}, called(args)]},
            "messages.1.tool_calls.0.function.arguments",
        )
        for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {}))
        for args in ('{"a": "\\ud800"}', '{"a": 1' + "0" * 5000 + "}")
    ),
    (
        "/v1/responses",
        {
            **RESPONSE,
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": "\\udfff"}'},
            ],
        },
        "input",
    ),
    # a batch of more prompts than the server holds at once names the field that holds them
    ("/generate", {"text": ["hi"] * 2000, "sampling_params": {"max_new_tokens": 1}}, "text"),
    ("/generate", {"input_ids": [[1]] * 2000, "sampling_params": {"max_new_tokens": 1}}, "input_ids"),
]


@pytest.fixture(scope="module")
def connection(server) -> Iterator[http.client.HTTPConnection]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    yield conn
    conn.close()


def send(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    return response.status, response.read()


@pytest.mark.parametrize("path,body,param", HOSTILE, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(HOSTILE)])
def test_hostile_input_is_4xx_and_keeps_the_connection(connection, path: str, body: dict, param: str) -> None:
    raw = json.dumps(body).encode()  # NaN, Infinity and \ud800 escapes, as Python's json writes them
    status, reply = send(connection, "POST", path, raw)
    assert 400 <= status < 500, (status, reply[:500])
    err = error_of(status, reply)
    assert err["param"] == param, err
    sock = connection.sock
    status, reply = send(connection, "GET", "/v1/models")  # the same keep-alive connection
    assert status == 200 and connection.sock is sock


def test_huge_numbers_that_mean_no_limit_are_served(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={**COMPLETION, "top_k": 2**70}, timeout=60)
    assert r.status_code == 200, r.text


def test_long_texts_are_encoded_one_at_a_time_and_short_ones_beside_them() -> None:
    """Each long text takes the tokenizer many times its memory: the prompt workers encode one at a
    time, and short texts beside it."""
    from deltaserve.server.api.context import LONG_TEXT_CHARS, encode_text

    class Backend:
        def __init__(self) -> None:
            self.running = self.most = 0
            self.lock = threading.Lock()

        def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[SimpleNamespace]:
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
            time.sleep(0.2)
            with self.lock:
                self.running -= 1
            return [SimpleNamespace(ids=[len(texts[0])])]

    def most_at_once(chars: int) -> int:
        tokenizer = SimpleNamespace(backend_tokenizer=Backend())
        threads = [threading.Thread(target=encode_text, args=(tokenizer, "a" * chars)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return tokenizer.backend_tokenizer.most

    assert most_at_once(LONG_TEXT_CHARS) == 1
    assert most_at_once(LONG_TEXT_CHARS - 1) == 3


HUGE_TEXT = "hello world " * 400_000  # 4.8 MB: seconds of tokenizing on a CPU
HUGE_PROMPTS = [
    ("/v1/completions", {**COMPLETION, "prompt": HUGE_TEXT, "truncate_prompt_tokens": 8}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": HUGE_TEXT}], "truncate_prompt_tokens": 8}),
    ("/tokenize", {"prompt": HUGE_TEXT}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("path,body", HUGE_PROMPTS, ids=[p for p, _ in HUGE_PROMPTS])
def test_a_huge_prompt_holds_up_no_other_requests_prompt(server, path: str, body: dict) -> None:
    """A prompt of megabytes, which truncate_prompt_tokens (or /tokenize) lets past the length
    check, is tokenized for seconds; small requests sent one after another meanwhile are each
    answered in a small part of that time, not after it."""
    done = threading.Event()
    big: dict[str, float] = {}

    def send_big() -> None:
        start = time.monotonic()
        try:
            big["status"] = httpx.post(f"{server.url}{path}", json=body, timeout=300).status_code
        finally:
            big["took"] = time.monotonic() - start
            done.set()

    thread = threading.Thread(target=send_big)
    thread.start()
    small: list[float] = []
    with httpx.Client(timeout=300) as http:
        while not done.is_set():
            start = time.monotonic()
            r = http.post(f"{server.url}/v1/chat/completions", json=CHAT)
            small.append(time.monotonic() - start)
            assert r.status_code == 200, r.text
    thread.join()
    assert big["status"] == 200
    assert len(small) >= 4 and max(small) < big["took"] / 4, (big, small)


@pytest.mark.slow
def test_a_batch_of_a_thousand_prompts_leaves_a_running_stream_its_steps(server, until_idle) -> None:
    """A /generate batch of 1,000 one-token prompts sent beside a sampled stream: the stream goes on
    getting tokens while the batch runs (one a step, the batch taking a running place each beside
    it), its longest wait a small part of the batch's time, and each of the batch's answers is its
    prompt's greedy tokens alone."""
    firsts = list(range(100, 20000, 1999))
    sampling = {"max_new_tokens": 2, "temperature": 0}
    url = f"{server.url}/generate"
    alone = {
        t: httpx.post(url, json={"input_ids": [t], "sampling_params": sampling}, timeout=60).json()[
            "output_ids"
        ]
        for t in firsts
    }
    started, batch_done = threading.Event(), threading.Event()
    events: list[float] = []

    def stream() -> None:
        body = {**COMPLETION, "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue  # the blank line after each event, and [DONE]
                events.append(time.monotonic())
                if len(events) >= 5:
                    started.set()
                if batch_done.is_set():
                    break  # leaving aborts it

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    prompts = [[firsts[i % len(firsts)]] for i in range(1000)]
    start = time.monotonic()
    try:
        r = httpx.post(url, json={"input_ids": prompts, "sampling_params": sampling}, timeout=600)
    finally:
        took = time.monotonic() - start
        batch_done.set()
        thread.join(60)
    assert r.status_code == 200, r.text[:500]
    assert [a["output_ids"] for a in r.json()] == [alone[p[0]] for p in prompts]
    during = [b - a for a, b in zip(events, events[1:]) if b > start and a < start + took]
    # at most max_running_requests (64 on CPU) of the batch run at once: 1,000 take 16 steps or more
    assert len(during) >= 10 and max(during) < took / 4, (took, sorted(during)[-5:])
    until_idle(server.url)


def test_a_requests_text_is_counted_in_every_message_part_and_prompt() -> None:
    from deltaserve.server.api.context import text_chars
    from deltaserve.server.protocol import ChatMessage

    messages = [
        ChatMessage(role="system", content="abc"),
        ChatMessage(
            role="user", content=[{"type": "text", "text": "de"}, {"type": "text", "text": "f" * 10}]
        ),
    ]
    assert text_chars(messages) == len("system") + 3 + len("user") + 2 + 10 + 2 * len("text")
    assert text_chars(["ab", "cde"]) == 5 and text_chars([[1, 2]]) == 0
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 1000}}
    assert text_chars([ChatMessage(role="user", content=[image])]) < 100


@pytest.mark.slow
def test_more_long_prompts_than_prompt_workers_hold_up_no_short_prompt(server, post_with_continue) -> None:
    """Long texts are tokenized one at a time: more of them at once than there are prompt workers
    wait for one another without taking the workers that short prompts need."""
    from deltaserve.server.api.context import LONG_TEXT_CHARS, PROMPT_WORKERS

    text = "hello world " * (LONG_TEXT_CHARS // 12 + 1)
    long_done: list[float] = []

    def send_long(sent: threading.Event) -> None:
        status, reply = post_with_continue(server.port, "/tokenize", {"prompt": text}, {}, sent)
        assert status == 200, str(reply)[:500]
        long_done.append(time.monotonic())

    start = time.monotonic()
    sent = [threading.Event() for _ in range(PROMPT_WORKERS + 8)]
    threads = [threading.Thread(target=send_long, args=(s,)) for s in sent]
    for t in threads:
        t.start()
    for s in sent:  # every long prompt has arrived, its whole text sent
        assert s.wait(60)
    small: list[float] = []
    with httpx.Client(timeout=600) as http:
        for _ in range(3):
            sent = time.monotonic()
            r = http.post(f"{server.url}/tokenize", json={"prompt": "hi"})
            small.append(time.monotonic() - sent)
            assert r.status_code == 200, r.text
    for t in threads:
        t.join()
    took = max(long_done) - start
    assert len(long_done) == len(threads)
    assert max(small) < took / 8, (took, small)


def raw_request(port: int, head: str, data: bytes, wait: float = 10.0) -> tuple[int, bytes, float]:
    """Send a request's head and the first bytes of its body, and read the answer (status, body,
    seconds until it came) without sending the rest."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        start = time.monotonic()
        sock.sendall(head.encode() + data)
        received = b""
        while b"\r\n\r\n" not in received or len(received.split(b"\r\n\r\n", 1)[1]) < _length(received):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        elapsed = time.monotonic() - start
    head_bytes, _, body = received.partition(b"\r\n\r\n")
    return int(head_bytes.split()[1]), body, elapsed


def _length(received: bytes) -> int:
    for line in received.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 60


def post_head(path: str, length: int, key: str | None = None) -> str:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n"
    )


def test_oversized_body_is_413_before_it_is_read(server) -> None:
    status, body, elapsed = raw_request(server.port, post_head("/v1/chat/completions", 10**9), b'{"model": ')
    assert status == 413 and elapsed < 5.0  # read, the body would hold it until the 10 s wait ends
    assert error_of(status, body)["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(server) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "x", "prompt": "'
        for _ in range(LIMIT // (1 << 20) + 2):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413
    error_of(r.status_code, r.content)


@pytest.fixture(scope="module")
def keyed(spawn_module_server):
    """A server with an API key and a small running batch and waiting queue."""
    return spawn_module_server(
        "--max-model-len", "2048", "--max-running-requests", "16", "--max-waiting-requests", "8",
        "--api-key", KEY,
    )  # fmt: skip


@pytest.mark.slow
def test_api_key_is_checked_before_the_body(keyed) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        status, body, elapsed = raw_request(keyed.port, post_head(path, 10_000_000), b'{"model": ')
        assert status == 401 and elapsed < 5.0
        assert error_of(status, body)["code"] == "invalid_api_key"
        # the key first, the size after
        status, _, _ = raw_request(keyed.port, post_head(path, 10**9, key="wrong"), b"{")
        assert status == 401


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,body",
    [
        ("/tokenize", {"prompt": "hello"}),
        ("/detokenize", {"tokens": [1, 2, 3]}),
        ("/reset_prefix_cache", {}),  # dropping everyone's cache is the key holder's to ask
        ("/flush_cache", {}),
        ("/abort_request", {"abort_all": True}),  # ending everyone's requests, likewise
        ("/update_weight_version", {"new_version": "v1"}),
        ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}),  # SGLang's
    ],
)
def test_tokenize_and_detokenize_need_the_key(keyed, path: str, body: dict) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{keyed.url}{path}", json=body, headers=headers, timeout=30)
        assert error_of(r.status_code, r.content)["type"] == "authentication_error"
    r = httpx.post(f"{keyed.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    for open_path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(f"{keyed.url}{open_path}", timeout=30).status_code == 200


@pytest.mark.slow
def test_burst_fills_running_and_waiting_before_refusing(keyed, read_metrics, until_idle) -> None:
    """40 streams at once against 16 running places and 8 waiting ones: exactly 24 admitted."""
    release = asyncio.Event()
    body = {"model": MODEL_NAME, "prompt": "count", "max_tokens": 2000, "ignore_eos": True, "stream": True}

    async def one(http: httpx.AsyncClient, statuses: list[int]) -> None:
        async with http.stream("POST", f"{keyed.url}/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            if r.status_code == 503:
                error_of(503, await r.aread())
                return
            await release.wait()  # hold the stream open: the request runs until we let go

    async def burst() -> list[int]:
        statuses: list[int] = []
        limits = httpx.Limits(max_connections=100)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as http:
            tasks = [asyncio.create_task(one(http, statuses)) for _ in range(40)]
            deadline = time.monotonic() + 60
            while len(statuses) < 40 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            metrics = await asyncio.to_thread(read_metrics, keyed.url)
            release.set()
            await asyncio.gather(*tasks)
        assert metrics["deltaserve_num_requests_running"] + metrics["deltaserve_num_requests_waiting"] == 24
        return statuses

    statuses = asyncio.run(burst())
    assert sorted(statuses) == [200] * 24 + [503] * 16
    assert read_metrics(keyed.url)['deltaserve_requests_rejected_total{reason="queue_full"}'] == 16
    idle = until_idle(keyed.url)
    assert idle["deltaserve_num_requests_running"] == idle["deltaserve_state_slots_used"] == 0


@pytest.mark.slow
def test_no_leak_after_random_requests_with_aborts(server, read_metrics, until_idle) -> None:
    """About 100 requests of every kind, some hostile, some given up early: the pools end idle."""
    rng = random.Random(0)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        chat = rng.random() < 0.5
        body: dict = dict(CHAT if chat else COMPLETION)
        body.update(max_tokens=rng.randint(1, 30), n=rng.choice([1, 1, 2]), stream=rng.random() < 0.6)
        if rng.random() < 0.3:
            body.update(temperature=0.8, top_p=0.9, presence_penalty=0.5, seed=i)
        if rng.random() < 0.15:
            body.update(
                rng.choice([{"temperature": NAN}, {"stop_token_ids": [10**9]}, {"logit_bias": {"x": 1}}])
            )
        give_up = rng.random() < 0.3
        if give_up:  # still running when its client leaves, however fast the machine (else no abort)
            body.update(max_tokens=400, ignore_eos=True)
        url = f"{server.url}/v1/{'chat/completions' if chat else 'completions'}"
        raw = json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        if body["stream"]:
            async with http.stream("POST", url, content=raw, headers=headers) as r:
                assert r.status_code < 500
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if give_up and lines > 3:
                        return  # closing the stream aborts the request
            return
        try:
            r = await asyncio.wait_for(http.post(url, content=raw, headers=headers), 0.2 if give_up else 120)
            assert r.status_code < 500, r.text
        except asyncio.TimeoutError:
            pass  # the client hung up: the server aborts it

    async def run() -> None:
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=120) as http:

            async def bounded(i: int) -> None:
                async with limit:
                    await one(http, i)

            await asyncio.gather(*(bounded(i) for i in range(100)))

    aborted = 'deltaserve_requests_total{outcome="abort"}'
    before = read_metrics(server.url)[aborted]
    asyncio.run(run())
    m = until_idle(server.url)
    assert m[aborted] - before >= 10  # the clients that gave up were aborted
    keys = ("num_requests_running", "num_requests_waiting", "kv_pages_used", "state_slots_used")
    assert all(m[f"deltaserve_{k}"] == 0 for k in keys), {k: m[f"deltaserve_{k}"] for k in keys}
    assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=60).status_code == 200


# ----------------------------------------------------------- a request that the engine fails alone


class FailingEngine:
    """The Engine interface: every request generates "ab" one token per step, but one whose seed is
    13 finishes with finish_reason "error" after its first token (a fault of its own)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = 512
        self.vocab_size = len(tokenizer)
        self.model_info = {"model": "failing", "architecture": "Failing"}
        self.eos_token_ids: list[int] = []
        self.script = tokenizer.encode("ab cd ef", add_special_tokens=False)
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.requests[request_id] = (prompt_token_ids, params, [])

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int]:
        return {"running": len(self.requests), "waiting": 0}

    def step(self) -> list[RequestOutput]:
        time.sleep(0.01)
        outputs = []
        for request_id, (prompt, params, out) in list(self.requests.items()):
            failed = params.seed == 13 and len(out) == 1
            if not failed:
                out.append(self.script[len(out)])
            done = failed or len(out) == len(self.script)
            reason = "error" if failed else ("stop" if done else None)
            tokens = out[-1:] if params.output_kind == "delta" and not failed else ([] if failed else out)
            text = self.tokenizer.decode(tokens)
            completion = CompletionOutput(0, tokens, text, reason, num_tokens=len(out))
            completion.error = "IndexError: secret internals" if failed else None
            if done or params.output_kind != "final_only":
                delta = params.output_kind == "delta"
                outputs.append(RequestOutput(request_id, prompt, [completion], done, delta=delta))
            if done:
                del self.requests[request_id]
        return outputs

    def flush_cache(self) -> None:
        raise AssertionError("secret internals")  # a bug of the engine's, not the caller's


@pytest.fixture(scope="module")
def failing_url(builtin_path: str) -> Iterator[str]:
    from transformers import AutoTokenizer

    from deltaserve.server.app import build_app
    from deltaserve.server.engine_client import EngineClient

    engine = FailingEngine(AutoTokenizer.from_pretrained(builtin_path))
    app = build_app(EngineClient.in_thread(engine), model_names=["failing"])
    with app_in_thread(app, join_s=10) as port:
        yield f"http://127.0.0.1:{port}"


def sse_data(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_request_failed_by_the_engine_ends_alone(failing_url: str, path: str) -> None:
    body = {"model": "failing", "max_tokens": 20, "seed": 13}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    with httpx.Client(base_url=failing_url, timeout=30) as http:
        with http.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_data(list(r.iter_lines()))
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert (
            err["type"] == "server_error"
            and "secret" not in err["message"]
            and "IndexError" not in err["message"]
        )
        assert all("error" not in json.loads(e) for e in events[:-2])  # the chunks before it are ordinary

        r = http.post(path, json=body)
        assert r.status_code == 500 and "secret" not in r.text and "IndexError" not in r.text
        assert r.json()["error"]["type"] == "server_error"

        ok = http.post(path, json={**body, "seed": 1})  # beside it, others finish normally
        assert ok.status_code == 200
        choice = ok.json()["choices"][0]
        assert choice["finish_reason"] == "stop"


@pytest.mark.slow
def test_response_failed_by_the_engine_is_an_error_event(failing_url: str) -> None:
    body = {"model": "failing", "input": "hi", "seed": 13, "stream": True}
    with httpx.stream("POST", f"{failing_url}/v1/responses", json=body, timeout=30) as r:
        events = [json.loads(e) for e in sse_data(list(r.iter_lines()))]
    assert events[-1]["type"] == "error" and "secret" not in events[-1]["message"]
    r = httpx.post(f"{failing_url}/v1/responses", json={**body, "stream": False}, timeout=30)
    assert r.status_code == 500 and "secret" not in r.text


def test_internal_error_is_a_500_that_keeps_the_connection(failing_url: str, caplog) -> None:
    """An engine bug behind an endpoint is a 500 in OpenAI's shape, logged once with its
    traceback, and the client's keep-alive connection goes on serving."""
    host, port = failing_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        with caplog.at_level("ERROR"):
            status, reply = send(conn, "POST", "/reset_prefix_cache")
        err = error_of(status, reply)
        assert status == 500 and err["type"] == "server_error" and "secret" not in err["message"]
        sock = conn.sock
        status, reply = send(conn, "GET", "/v1/models")
        assert status == 200 and conn.sock is sock, "the connection was closed after the 500"
    finally:
        conn.close()
    logged = [r for r in caplog.records if r.exc_info and "secret internals" in str(r.exc_info[1])]
    assert len(logged) == 2, [r.getMessage() for r in caplog.records]  # the engine's call, the server's


MESSAGE = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
USER = {"role": "user", "content": "hi"}


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON, deeper than Python's recursion limit
NESTED: dict = {}
for _ in range(600):
    NESTED = {"a": NESTED}


def _assistant_calls(*calls: object) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


# bad requests on the less travelled endpoints and fields: (path, body, the param its 400 names;
# None on /v1/messages, whose errors have no param)
BESIDE_STREAMS = [
    # an earlier turn's tool call whose function is not an object with a string name
    ("/v1/chat/completions", {**CHAT, "messages": [USER, _assistant_calls({"function": 5}), USER]},
     "messages.1.tool_calls.0.function"),
    ("/v1/chat/completions", {**CHAT, "messages": [USER, _assistant_calls({"function": "f"}), USER]},
     "messages.1.tool_calls.0.function"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [USER, _assistant_calls({"function": {"name": None, "arguments": "{}"}}), USER]},
     "messages.1.tool_calls.0.function"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [USER, _assistant_calls({"function": {"name": "f", "arguments": 5}}), USER]},
     "messages.1.tool_calls.0.function.arguments"),
    # a call without its arguments: the template's tojson of an undefined, a 400 that named no field
    ("/v1/chat/completions",
     {**CHAT, "messages": [USER, _assistant_calls({"id": "c", "type": "function", "function": {"name": "f"}}), USER]},
     "messages.1.tool_calls.0.function.arguments"),
    ("/tokenize", {"messages": [USER, _assistant_calls({"function": 5})]}, "messages.1.tool_calls.0.function"),
    # arguments (a JSON string, so past the body's nesting bound) nested deeper than a parser recurses
    ("/v1/chat/completions",
     {**CHAT, "messages": [USER, _assistant_calls({"function": {"name": "f", "arguments": DEEP}}), USER]},
     "messages.1.tool_calls.0.function.arguments"),
    ("/tokenize", {"messages": [USER, _assistant_calls({"function": {"name": "f", "arguments": DEEP}})]},
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/responses", {**RESPONSE, "input": [
        USER, {"type": "function_call", "call_id": "c", "name": "f", "arguments": DEEP}]}, "input"),
    # objects the body parser takes but the template's renderer recurses past Python's limit on
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"x": NESTED}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": [USER, _assistant_calls(
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": NESTED}})]},
     "messages.1.tool_calls.0.function.arguments"),
    # a text block or part whose text is not a string, a tool_use block or function_call item of
    # the wrong types: 400s, not a Python repr ("{'a': 1}", "None") in the prompt
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
     None),
    ("/v1/messages", {**MESSAGE, "system": [{"type": "text", "text": 5}]}, None),
    ("/v1/messages/count_tokens", {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     None),
    ("/v1/messages", {**MESSAGE, "messages": [
        USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1, 2]}]}, USER]},
     None),
    ("/v1/messages", {**MESSAGE, "messages": [
        USER, {"role": "assistant", "content": [{"type": "tool_use", "id": 7, "name": "f", "input": {}}]}, USER]},
     None),
    ("/v1/responses", {**RESPONSE, "input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input"),
    ("/v1/responses", {**RESPONSE, "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
    ("/v1/responses", {**RESPONSE, "input": [USER, {"type": "function_call", "call_id": "c", "arguments": "{}"}]},
     "input"),
    ("/v1/responses", {**RESPONSE, "input": [
        USER, {"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}]}, "input"),
    ("/v1/responses", {**RESPONSE, "input": [
        USER, {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, "input"),
    # an image_url part without its image_url, an Anthropic image block whose source is no object
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0.type"),
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]},
     None),
    # vLLM's fields of this week, wrong or in combinations they refuse
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "logprob_token_ids": [-1]}, "logprob_token_ids"),
    ("/v1/completions", {**COMPLETION, "logprobs": 1, "logprob_token_ids": [2**70]}, "logprob_token_ids"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "logprob_token_ids": list(range(129))}, "logprob_token_ids"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "logprob_token_ids": ["a"]}, "logprob_token_ids.0"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "logprob_token_ids": [1], "use_beam_search": True, "n": 2},
     "logprob_token_ids"),
    ("/v1/completions", {**COMPLETION, "echo": True, "max_tokens": 0, "logprobs": 1, "logprob_token_ids": [1]},
     "logprob_token_ids"),
    ("/v1/chat/completions", {**CHAT, "cache_salt": "", "stream": True, "n": 2}, "cache_salt"),
    ("/v1/completions", {**COMPLETION, "cache_salt": 5, "use_beam_search": True, "n": 2}, "cache_salt"),
    ("/v1/responses", {**RESPONSE, "cache_salt": []}, "cache_salt"),
    ("/v1/messages", {**MESSAGE, "cache_salt": ""}, None),
    ("/v1/chat/completions", {**CHAT, "echo": True, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "echo": True, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "include_reasoning": [], "stream": True}, "include_reasoning"),
    ("/v1/chat/completions", {**CHAT, "return_token_ids": True, "use_beam_search": True, "n": 2},
     "return_token_ids"),
    ("/v1/chat/completions", {**CHAT, "return_prompt_text": [], "n": 2}, "return_prompt_text"),
    ("/v1/completions", {**COMPLETION, "truncation_side": "middle", "truncate_prompt_tokens": 2},
     "truncation_side"),
    ("/v1/chat/completions", {**CHAT, "documents": [1], "use_beam_search": True, "n": 2}, "documents.0"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "HIGH", "stream": True}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 10**400}, "stream": True, "n": 2}, "logit_bias.5"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 1e300}, "use_beam_search": True, "n": 2}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "temperature": 0.001, "use_beam_search": True, "n": 2}, "temperature"),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {**CHAT, "n": 129, "stream": True, "echo": True, "logprobs": True}, "n"),
]  # fmt: skip


JSON = {"content-type": "application/json"}


async def _stream_events(http: httpx.AsyncClient, url: str, path: str, body: dict) -> AsyncIterator[dict]:
    """A good stream's events, its data lines decoded."""
    async with http.stream("POST", f"{url}{path}", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])


async def _stream_text(http: httpx.AsyncClient, url: str, path: str, body: dict) -> str:
    """A good stream's text, joined from its events (how many steps an event carries may vary)."""
    pieces: list[str] = []
    async for event in _stream_events(http, url, path, body):
        if path == "/generate":
            pieces = [event["text"]]  # each event has the text so far
        elif path == "/v1/chat/completions":
            pieces += [
                (c["delta"].get("reasoning_content") or "") + (c["delta"].get("content") or "")
                for c in event["choices"]
            ]
        elif path == "/v1/messages" and event["type"] == "content_block_delta":
            pieces.append(event["delta"].get("text") or event["delta"].get("thinking") or "")
        elif path == "/v1/responses" and event["type"].endswith("text.delta"):
            pieces.append(event["delta"])
    return "".join(pieces)


GOOD_STREAMS = [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
                   "stream": True}),
    ("/v1/messages", {**MESSAGE, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}),
    ("/v1/responses", {**RESPONSE, "max_output_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}),
]  # fmt: skip


@pytest.mark.slow
def test_bad_requests_beside_good_streams_are_4xx_and_hurt_no_one(server, until_idle) -> None:
    """Each bad request is a 4xx in its API's error shape naming the field, while greedy streams on
    every endpoint run beside them and give what they give alone; the engine ends idle."""

    async def run() -> tuple[list[str], list[str], list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as http:
            alone = [await _stream_text(http, server.url, p, b) for p, b in GOOD_STREAMS]
            good = [asyncio.create_task(_stream_text(http, server.url, p, b)) for p, b in GOOD_STREAMS]
            bad = await asyncio.gather(
                *(
                    http.post(f"{server.url}{p}", content=json.dumps(b).encode(), headers=JSON)
                    for p, b, _ in BESIDE_STREAMS
                )
            )
            return alone, list(await asyncio.gather(*good)), bad

    alone, beside, replies = asyncio.run(run())
    assert all(alone) and beside == alone
    for (path, _, param), r in zip(BESIDE_STREAMS, replies):
        assert 400 <= r.status_code < 500, (path, param, r.status_code, r.text)
        if path.startswith("/v1/messages"):
            body = r.json()
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        else:
            assert error_of(r.status_code, r.content)["param"] == param, (path, r.text)
    idle = until_idle(server.url)
    assert all(
        idle[f"deltaserve_{k}"] == 0 for k in ("num_requests_running", "kv_pages_used", "state_slots_used")
    )
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def anthropic_error_of(status: int, body: bytes) -> dict:
    """The Anthropic error object of an error reply (asserting its shape)."""
    assert status >= 400, (status, body[:500])
    payload = json.loads(body)
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}, payload
    return payload["error"]


@pytest.mark.slow
def test_messages_refused_before_the_body_get_anthropics_error_shape(server, keyed) -> None:
    """The key and size checks, made before a body is read, answer /v1/messages in Anthropic's
    shape as its other errors are (its SDKs read `error.type`), and every other route in OpenAI's."""
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, body, _ = raw_request(server.port, post_head(path, 10**9), b"{")
        assert status == 413 and anthropic_error_of(status, body)["type"] == "request_too_large"
        status, body, _ = raw_request(keyed.port, post_head(path, 10), b"{")
        assert status == 401 and anthropic_error_of(status, body)["type"] == "authentication_error"
    status, body, _ = raw_request(server.port, post_head("/v1/responses", 10**9), b"{")
    assert error_of(status, body)["code"] == "request_too_large"


FUNCTION = {"name": "f", "parameters": {"type": "object"}}
# calls the model writes (forced here by a one-choice grammar) that Python's json reads but no reply
# can carry: an unpaired surrogate escape, in the arguments or the name
UNCARRIED_CALLS = ['<tool_call>\n{"name": "\\udbff", "arguments": {}}\n</tool_call>']
# a call whose arguments decode to a lone surrogate, and the arguments the reply writes for them:
# the surrogate as its JSON escape (a string's text is the arguments, as a model's encoded object)
ESCAPED_ARGUMENTS = [
    ('<tool_call>\n{"name": "f", "arguments": {"a": "\\ud800"}}\n</tool_call>', '{"a": "\\ud800"}'),
    ('<tool_call>\n{"name": "f", "arguments": "\\udc00"}\n</tool_call>', "\\udc00"),
]


def _forced(path: str, output: str, stream: bool) -> dict:
    common = {"model": MODEL_NAME, "stream": stream, "guided_choice": [output]}
    if path == "/v1/chat/completions":
        return {
            **common,
            "messages": [USER],
            "max_tokens": 300,
            "tools": [{"type": "function", "function": FUNCTION}],
        }
    if path == "/v1/responses":
        return {
            **common,
            "input": "hi",
            "max_output_tokens": 300,
            "tools": [{"type": "function", **FUNCTION}],
        }
    tool = {"name": "f", "input_schema": {"type": "object"}}
    return {**common, "messages": [USER], "max_tokens": 300, "tools": [tool]}


def _reply_text(path: str, reply: dict) -> str:
    """An unstreamed reply's text, asserting it holds nothing but text."""
    if path == "/v1/chat/completions":
        (choice,) = reply["choices"]
        assert choice["message"]["tool_calls"] is None, reply
        return choice["message"]["content"]
    if path == "/v1/responses":
        (item,) = reply["output"]
        assert item["type"] == "message", reply
        return "".join(part["text"] for part in item["content"])
    assert [block["type"] for block in reply["content"]] == ["text"], reply
    return reply["content"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_call_no_reply_can_carry_stays_content(server, until_idle, path: str, stream: bool) -> None:
    """A call whose name decodes to a lone surrogate is not read as a call: its text is the reply's
    content, where it was a 500 (or a stream cut off, or ended by an error)."""

    async def streamed(body: dict) -> str:
        async with httpx.AsyncClient(timeout=60) as http:
            return await _stream_text(http, server.url, path, body)

    for output in UNCARRIED_CALLS:
        body = _forced(path, output, stream)
        if stream:
            text = asyncio.run(streamed(body))
        else:
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            assert r.status_code == 200, (output, r.text[:500])
            text = _reply_text(path, r.json())
        assert text == output.strip(), (output, text)
    assert until_idle(server.url)["deltaserve_state_slots_used"] == 0


async def _stream_calls(http: httpx.AsyncClient, url: str, path: str, body: dict) -> list[tuple[str, str]]:
    """A chat or Responses stream's calls, (name, arguments joined from their fragments)."""
    calls: list[list[str]] = []
    async for event in _stream_events(http, url, path, body):
        if path == "/v1/chat/completions":
            for c in event["choices"]:
                for call in c["delta"].get("tool_calls") or []:
                    if call["index"] == len(calls):
                        calls.append([call["function"]["name"], ""])
                    calls[call["index"]][1] += call["function"].get("arguments") or ""
        elif event["type"] == "response.output_item.added" and event["item"]["type"] == "function_call":
            calls.append([event["item"]["name"], ""])
        elif event["type"] == "response.function_call_arguments.delta":
            calls[-1][1] += event["delta"]
    return [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_call_whose_arguments_no_reply_can_carry_writes_them_escaped(
    server, until_idle, path: str, stream: bool
) -> None:
    """Arguments that decode to a lone surrogate, which no reply can carry, keep the call: its
    arguments write the surrogate as its JSON escape (a stream has sent the name before them); a
    Messages tool_use, whose input is an object the reply carries, has an empty input, and its
    stream sends the input up to the surrogate, which Anthropic's SDK cannot parse ({} where the
    arguments are no object)."""
    sent = ['{"a": "', "{}"]  # ESCAPED_ARGUMENTS' streamed tool_use inputs
    for (output, arguments), streamed_input in zip(ESCAPED_ARGUMENTS, sent, strict=True):
        body = _forced(path, output, stream)
        if path == "/v1/messages":
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            assert r.status_code == 200, (output, r.text[:500])
            if stream:
                events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
                starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
                deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
                assert [(b["type"], b["name"]) for b in starts] == [("tool_use", "f")], events
                assert "".join(deltas) == streamed_input, events
            else:
                blocks = [(b["type"], b["name"], b["input"]) for b in r.json()["content"]]
                assert blocks == [("tool_use", "f", {})], r.text
            continue
        if stream:

            async def streamed(body: dict = body) -> list[tuple[str, str]]:
                async with httpx.AsyncClient(timeout=60) as http:
                    return await _stream_calls(http, server.url, path, body)

            calls = asyncio.run(streamed())
        else:
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            assert r.status_code == 200, (output, r.text[:500])
            reply = r.json()
            if path == "/v1/chat/completions":
                (choice,) = reply["choices"]
                assert choice["finish_reason"] == "tool_calls", reply
                calls = [
                    (c["function"]["name"], c["function"]["arguments"])
                    for c in choice["message"]["tool_calls"]
                ]
            else:
                calls = [(i["name"], i["arguments"]) for i in reply["output"] if i["type"] == "function_call"]
        assert calls == [("f", arguments)], (output, calls)
    assert until_idle(server.url)["deltaserve_state_slots_used"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_messages_call_whose_arguments_no_reply_can_carry_has_empty_input(server, stream: bool) -> None:
    """Anthropic's tool_use input is an object the reply encodes: arguments with NaN or a number past
    a float's range (json reads 1e400 as infinity) give an empty input, as arguments that are no
    object do, where the reply was a 500; a stream sends the input up to that number."""
    for args in ('{"a": NaN}', '{"a": -1e400}', '"{\\"a\\": Infinity}"'):
        output = f'<tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>'
        r = httpx.post(f"{server.url}/v1/messages", json=_forced("/v1/messages", output, stream), timeout=60)
        assert r.status_code == 200, (args, r.text[:500])
        if stream:
            events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
            starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
            deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
            assert [b["type"] for b in starts] == ["tool_use"] and "".join(deltas) == '{"a": ', events
        else:
            assert [(b["type"], b["input"]) for b in r.json()["content"]] == [("tool_use", {})], r.text
