"""`--data-parallel-size 2`: two engine processes behind the HTTP processes. Both serve requests
and give the tokens one engine gives; a chat's next turn goes where its history is cached; /metrics
adds the engines up and shows each; disconnects and cache resets reach the engine that holds the
request; one engine's death fails its own requests, not the other's, and turns /health to 503."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
from typing import Any

import httpx
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

from .test_api_servers import gone
from .test_engine_process import children_of, stream_events, wait_for

# Servers of several engine processes, started per test
pytestmark = pytest.mark.slow

DP = ("--data-parallel-size", "2", "--max-model-len", "512")


def engine_pids(server) -> list[int]:
    match = re.search(r"engine processes \(data parallel\) pid ([\d, ]+)", server.log())
    assert match, server.log()[-2000:]
    return [int(p) for p in match.group(1).split(", ")]


def per_engine(url: str, name: str) -> list[float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(rf'^deltaserve_dp_{name}{{[^}}]*engine="(\d)"}} (\S+)$', text, re.M)
    return [float(v) for _, v in sorted(found)]


def long_streams(url: str, n: int) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    """n streamed completions of 480 tokens, each in a thread (started), and where each one's
    events go (`stream_events`)."""
    body = {"model": MODEL_NAME, "max_tokens": 480, "ignore_eos": True}
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    threads = [
        threading.Thread(
            target=stream_events,
            args=(f"{url}/v1/completions", {**body, "prompt": f"stream {i}"}, results[i]),
        )
        for i in range(n)
    ]
    for t in threads:
        t.start()
    return threads, results


@pytest.fixture(scope="module")
def dp_server(spawn_module_server):
    return spawn_module_server(*DP, "--api-server-count", "2")


def completions(url: str, prompts: list[str], max_tokens: int = 8) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as http:

            async def one(prompt: str) -> str:
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                r = await http.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


def test_both_engines_serve_and_give_one_engines_tokens(dp_server, server) -> None:
    first, second = engine_pids(dp_server)
    assert {first, second} <= set(children_of(dp_server.proc.pid))
    prompts = [f"prompt number {i} says" + " word" * (i % 7) for i in range(24)]
    got = completions(dp_server.url, prompts)
    assert got == completions(server.url, prompts)  # a server of one engine: the same greedy tokens
    prompt_tokens = per_engine(dp_server.url, "prompt_tokens_total")
    assert len(prompt_tokens) == 2 and min(prompt_tokens) > 0, prompt_tokens
    total = httpx.get(f"{dp_server.url}/metrics").text
    summed = float(re.search(r"^deltaserve_prompt_tokens_total{[^}]*} (\S+)$", total, re.M).group(1))
    assert summed == sum(prompt_tokens)
    assert httpx.get(f"{dp_server.url}/get_model_info").status_code == 200


def test_a_chats_next_turns_hit_the_cache_of_the_engine_that_served_it(dp_server) -> None:
    """Five chats of three turns, interleaved: each turn after the first finds its history cached,
    which only the engine that served the turn before holds (an odd count, so that taking the
    engines in turn would not send a chat back to the same one by chance)."""
    import openai

    client = openai.OpenAI(base_url=f"{dp_server.url}/v1", api_key="unused", max_retries=0)
    chats: list[list[dict[str, str]]] = [
        [{"role": "user", "content": f"chat {i}: " + "tell me about the sea and the sky " * 12}]
        for i in range(5)
    ]
    for turn in range(3):
        for i, messages in enumerate(chats):
            reply = client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0
            )
            cached = reply.usage.prompt_tokens_details.cached_tokens
            if turn:
                # the history up to its last page before the new message at least
                assert cached >= 64, (turn, i, reply.usage)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"and then {turn}, chat {i}?"},
            ]


def test_a_chats_turns_on_new_connections_find_their_engine_from_any_http_process(dp_server) -> None:
    """Each turn on a connection of its own, which either HTTP process may take: the routing
    table they share still sends it to the engine that holds its history."""
    chats = [
        [{"role": "user", "content": f"fresh {i}: " + "a long question about rivers " * 14}] for i in range(5)
    ]

    def served() -> set[str]:  # the HTTP processes that took the turns ("uvicorn.access[1]:" the second)
        return {
            line.split()[3] for line in dp_server.log().splitlines() if "POST /v1/chat/completions" in line
        }

    # which process accepts a connection is the kernel's choice: turns go on until both have taken some
    for turn in range(12):
        if turn >= 3 and len(served()) == 2:
            break
        for i, messages in enumerate(chats):
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "temperature": 0}
            with httpx.Client(timeout=60, headers={"Connection": "close"}) as http:
                reply = http.post(f"{dp_server.url}/v1/chat/completions", json=body).json()
            if turn:
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64, (
                    turn,
                    i,
                    reply["usage"],
                )
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"and {turn}?"},
            ]
    assert len(served()) == 2, served()  # both HTTP processes took turns


def test_disconnected_streams_free_their_engines_slots(dp_server, until_idle) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as http:

            async def leave_early(i: int) -> None:
                async with http.stream(
                    "POST", f"{dp_server.url}/v1/completions", json={**body, "prompt": f"leaving {i}"}
                ) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return  # the first chunk, then away

            await asyncio.gather(*(leave_early(i) for i in range(8)))

    asyncio.run(run())
    metrics = until_idle(dp_server.url)
    assert metrics["deltaserve_num_requests_running"] == 0 and metrics["deltaserve_state_slots_used"] == 0
    assert per_engine(dp_server.url, "state_slots_used") == [0, 0]


def test_streams_taken_by_different_http_processes_spread_over_the_engines(dp_server, until_idle) -> None:
    """Two streams at once, each on a connection of its own: whichever HTTP process takes each,
    they run on different engines (every process counts the others' requests in flight; alone,
    two processes each holding one stream would both pick engine 0). Rounds go on until one
    round's streams met different processes."""
    body = {"model": MODEL_NAME, "max_tokens": 480, "ignore_eos": True, "stream": True}

    async def round_(i: int) -> tuple[list[int], list[float]]:
        async with contextlib.AsyncExitStack() as stack:
            ports: list[int] = []
            held = []
            for j in range(2):
                http = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
                r = await stack.enter_async_context(
                    http.stream(
                        "POST", f"{dp_server.url}/v1/completions", json={**body, "prompt": f"spread {i} {j}"}
                    )
                )
                ports.append(r.extensions["network_stream"].get_extra_info("client_addr")[1])
                lines = r.aiter_lines()  # held: an iterator dropped would close the stream
                held.append(lines)
                async for line in lines:
                    if line.startswith("data: "):
                        break  # running: counted where it went
            return ports, per_engine(dp_server.url, "num_requests_running")

    apart = 0
    for i in range(40):
        ports, running = asyncio.run(round_(i))
        until_idle(dp_server.url)
        log = dp_server.log()
        takers = {re.search(rf"(uvicorn\.access(?:\[\d\])?): 127\.0\.0\.1:{p} ", log).group(1) for p in ports}
        assert running == [1, 1], (i, takers, running)
        apart += len(takers) == 2
        if apart:
            break
    assert apart, "every round's two streams met the same HTTP process"


def test_mixed_traffic_through_both_http_processes_keeps_tokens_and_frees_everything(
    dp_server, server, until_idle
) -> None:
    """Greedy requests of every API, streamed or not, beside disconnects, aborts by name, bad
    requests, cache resets, relabels and polled /health and /metrics, each on a connection of its
    own: every greedy request gives the tokens it gives alone on one engine, nothing is a 5xx or
    hangs, /health stays 200, and afterwards both engines hold nothing."""
    url = dp_server.url
    texts = [f"mixed {i}: " + "the sea and the sky " * (i % 5) for i in range(12)]
    greedy = [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": texts[i], "max_tokens": 8, "temperature": 0})
        for i in range(4)
    ] + [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": texts[4:7], "max_tokens": 6, "temperature": 0}),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": texts[7], "max_tokens": 6, "n": 2, "seed": 5}),
        (
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": texts[8]}],
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": True,
                "stop": ["sea"],
            },
        ),
        ("/generate", {"text": texts[9], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}),
        (
            "/v1/messages",
            {
                "model": MODEL_NAME,
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": texts[10]}],
            },
        ),
        (
            "/v1/responses",
            {"model": MODEL_NAME, "input": texts[11], "max_output_tokens": 16, "temperature": 0},
        ),
    ]

    def answer(path: str, reply: dict[str, Any]) -> Any:
        """What greedy decoding decides: each choice's text (tokens, on /generate) and why it ended."""
        if path == "/generate":
            return reply["output_ids"], reply["meta_info"]["finish_reason"]["type"]
        if path == "/v1/messages":
            return reply["content"], reply["stop_reason"]
        if path == "/v1/responses":
            return reply["output"][-1]["content"], reply["status"]
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        return [(c.get("text") or c["message"]["content"], c["finish_reason"]) for c in choices]

    statuses: list[tuple[str, int]] = []
    health: list[int] = []

    async def run() -> list[Any]:
        done = asyncio.Event()

        async def fresh(method: str, path: str, **kwargs: Any) -> httpx.Response:
            async with httpx.AsyncClient(timeout=120, headers={"Connection": "close"}) as http:
                r = await http.request(method, f"{url}{path}", **kwargs)
                statuses.append((path, r.status_code))
                return r

        async def poll() -> None:
            while not done.is_set():
                health.append((await fresh("GET", "/health")).status_code)
                await fresh("GET", "/metrics")
                await asyncio.sleep(0.05)

        async def good(path: str, body: dict[str, Any]) -> Any:
            r = await fresh("POST", path, json=body)
            assert r.status_code == 200, r.text
            return answer(path, r.json())

        async def leave_early(i: int) -> None:
            body = {
                "model": MODEL_NAME,
                "prompt": [f"away {i}", f"gone {i}"],
                "max_tokens": 300,
                "stream": True,
            }
            async with httpx.AsyncClient(timeout=120) as http:
                async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return

        async def aborted(i: int) -> None:
            body = {"text": f"named {i}", "rid": f"mixed-{i}", "sampling_params": {"max_new_tokens": 300}}
            call = asyncio.create_task(fresh("POST", "/generate", json=body))
            await asyncio.sleep(0.2)
            await fresh("POST", "/abort_request", json={"rid": f"mixed-{i}"})
            assert (await call).status_code == 200

        async def bad() -> None:
            for path, body in [
                ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "temperature": 9}),
                ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}),
                ("/generate", {"text": "x", "sampling_params": {"no_such_field": 1}}),
            ]:
                r = await fresh("POST", path, json=body)
                assert r.status_code == 400 and r.json()["error"]["message"], r.text

        async def admin() -> None:
            for path, body in [
                ("/reset_prefix_cache", None),
                ("/update_weight_version", {"new_version": "mixed"}),
            ]:
                assert (await fresh("POST", path, json=body)).status_code == 200

        poller = asyncio.create_task(poll())
        try:
            results = await asyncio.wait_for(
                asyncio.gather(
                    *(good(path, body) for path, body in greedy),
                    *(leave_early(i) for i in range(3)),
                    *(aborted(i) for i in range(2)),
                    bad(),
                    admin(),
                ),
                120,
            )
        finally:
            done.set()
            await poller
        return results[: len(greedy)]

    got = asyncio.run(run())
    for (path, body), mixed in zip(greedy, got):
        alone = httpx.post(f"{server.url}{path}", json=body, timeout=120)  # a server of one engine, idle
        assert mixed == answer(path, alone.json()), (path, body)
    assert not [s for s in statuses if s[1] >= 500], statuses
    assert health and set(health) == {200}, health
    metrics = until_idle(url)
    assert metrics["deltaserve_num_requests_running"] == metrics["deltaserve_num_requests_waiting"] == 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_pages_used", "state_slots_used"):
        assert per_engine(url, name) == [0, 0], name


def test_a_batch_of_prompts_spreads_over_the_engines(dp_server, server) -> None:
    prompts = [f"batch prompt {i}" for i in range(8)]
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 6, "n": 2, "temperature": 1, "top_k": 1}
    before = per_engine(dp_server.url, "prompt_tokens_total")

    def texts(url: str) -> list[str]:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])]

    assert texts(dp_server.url) == texts(server.url)  # each prompt's choices in their places
    gained = [a - b for a, b in zip(per_engine(dp_server.url, "prompt_tokens_total"), before)]
    assert min(gained) > 0, gained  # both engines took some of the batch


def test_a_cache_reset_reaches_every_engine(dp_server) -> None:
    prompts = [f"{i}: a prompt long enough to fill some pages" * 8 for i in range(6)]  # nothing shared
    completions(dp_server.url, prompts, max_tokens=2)
    assert min(per_engine(dp_server.url, "prefix_cache_query_tokens_total")) > 0
    assert httpx.post(f"{dp_server.url}/reset_prefix_cache").status_code == 200
    hits = per_engine(dp_server.url, "prefix_cache_hit_tokens_total")
    completions(dp_server.url, prompts, max_tokens=2)
    assert per_engine(dp_server.url, "prefix_cache_hit_tokens_total") == hits  # nothing left to hit


def test_health_generate_asks_every_engine_for_a_token(dp_server) -> None:
    """Every engine runs a step for the probe; its token stays out of the token counters."""
    steps, tokens = (
        per_engine(dp_server.url, k) for k in ("engine_step_seconds_total", "prompt_tokens_total")
    )
    assert httpx.get(f"{dp_server.url}/health_generate", timeout=60).json() == {"status": "ok"}
    after = per_engine(dp_server.url, "engine_step_seconds_total")
    assert len(after) == 2 and all(a > b for a, b in zip(after, steps)), (steps, after)
    assert per_engine(dp_server.url, "prompt_tokens_total") == tokens


def test_the_load_generator_reports_the_engines_mean_loop_shares(dp_server) -> None:
    from bench.serving.serve import main

    shape = ["--input-len", "16", "--output-len", "8", "--num-prompts", "16", "--concurrency", "8"]
    run = main(["--base-url", dp_server.url, *shape])["runs"][0]
    assert run["failed"] == 0 and run["completed"] == 16
    loop = run["engine_loop"]  # each engine's loop is busy or idle: their mean share is at most 1
    assert 0 < loop["step"] and 0 <= loop["idle"] and loop["step"] + loop["idle"] <= 1, loop


def test_a_batch_that_one_engine_refuses_is_refused_whole(spawn_server, until_idle) -> None:
    """Two places an engine (one running, one waiting). More prompts than both idle engines hold
    is a 400 (no retry gets past it). With one long request running on each engine, one place is
    left on each: three prompts split two and one, the engine given two refuses them, and the one
    the other took is undone: a 503, and nothing of the batch runs."""
    small = spawn_server(*DP, "--max-running-requests", "1", "--max-waiting-requests", "1")
    body = {"model": MODEL_NAME, "prompt": [f"p{i}" for i in range(5)], "max_tokens": 4}
    too_many = httpx.post(f"{small.url}/v1/completions", json=body, timeout=60)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    threads, _ = long_streams(small.url, 2)
    wait_for(lambda: sorted(per_engine(small.url, "num_requests_running")) == [1, 1])
    before = per_engine(small.url, "prompt_tokens_total")
    three = {**body, "prompt": ["a", "b", "c"]}
    refused = httpx.post(f"{small.url}/v1/completions", json=three, timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
    # the engine given one prompt admitted it (counted as it is added) before the refusal undid it
    after = per_engine(small.url, "prompt_tokens_total")
    assert max(a - b for a, b in zip(after, before)) > 0, (before, after)
    assert httpx.post(f"{small.url}/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(120)
    metrics = until_idle(small.url)
    assert metrics["deltaserve_num_requests_running"] == metrics["deltaserve_state_slots_used"] == 0
    assert metrics['deltaserve_requests_total{outcome="length"}'] == 0  # nothing of the batch ran to the end
    fits = httpx.post(f"{small.url}/v1/completions", json=three, timeout=60)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 3
    # one prompt three times is three prompts, spread as three others are (it was one prompt's
    # three samples, a 400 naming n: more than one engine holds)
    same = httpx.post(f"{small.url}/v1/completions", json={**body, "prompt": ["a"] * 3}, timeout=60)
    assert same.status_code == 200 and len(same.json()["choices"]) == 3


def test_one_engines_death_fails_its_own_requests_and_health(spawn_server) -> None:
    server = spawn_server(*DP)
    pids = engine_pids(server)
    threads, results = long_streams(server.url, 4)
    wait_for(lambda: sorted(per_engine(server.url, "num_requests_running")) == [2, 2])
    os.kill(pids[1], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    failed = [r for r in results if any('"error"' in e for e in r["events"])]
    whole = [r for r in results if any('"finish_reason":"length"' in e for e in r["events"])]
    assert len(failed) == 2 and len(whole) == 2, [r["events"][-2:] for r in results]
    assert all(r["events"][-1] == "[DONE]" for r in results)
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "engine 1" in health.json()["reason"]
    refused = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"


def test_replicas_of_two_tensor_parallel_ranks_each(spawn_server, server) -> None:
    """-dp 2 -tp 2 on CPU: two engines, each with its own worker rank and rendezvous (gloo)."""
    dp_tp = spawn_server(*DP, "--tensor-parallel-size", "2", "--device", "cpu")
    prompts = [f"split {i} ways" + " and more" * i for i in range(8)]
    assert completions(dp_tp.url, prompts) == completions(server.url, prompts)
    assert min(per_engine(dp_tp.url, "prompt_tokens_total")) > 0
    joined = re.findall(r"tensor-parallel rank (\d) of 2 joined", dp_tp.log())
    assert sorted(joined) == ["0", "0", "1", "1"], dp_tp.log()[-3000:]  # two groups of two ranks


def test_sigterm_drains_and_stops_every_engine(spawn_server) -> None:
    server = spawn_server(*DP)
    pids = engine_pids(server)
    assert completions(server.url, ["before the end"])
    assert server.stop() == 0
    wait_for(lambda: all(gone(pid) for pid in pids), timeout=30)
