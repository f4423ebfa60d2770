"""POST /update_weights_from_disk (SGLang's) on a real server over the built-in model: the reply
after it is the offline engine's with the new checkpoint; a stream running when it arrives ends
with the old weights' tokens, and a request sent meanwhile waits and gets the new ones; a
checkpoint of another model or none is a 400 that leaves the server serving the same weights.
A request held by an update counts as waiting in /metrics until the update lets it in."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch

from deltaserve import LLM, SamplingParams

from .conftest import metrics_of, wait_idle

# Servers of its own, and a checkpoint written per update
pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "ignore_eos": True}
LONG = 200  # tokens: a stream still running when the update and the next request arrive


def perturbed_copy(src: str, dst: str, seed: int) -> str:
    """The checkpoint with noise on every floating-point weight: the same model, other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            file = os.path.join(dst, name)
            sd = load_file(file)
            for k, t in sd.items():
                if t.is_floating_point():
                    sd[k] = t + 0.05 * torch.randn(t.shape, generator=g).to(t.dtype)
            save_file(sd, file, metadata={"format": "pt"})
    return dst


def offline_text(path: str, max_tokens: int) -> str:
    llm = LLM(path, device="cpu", max_model_len=256)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return out[0].outputs[0].text


@pytest.fixture(scope="module")
def checkpoints(builtin_path, tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("weights")
    first = shutil.copytree(builtin_path, root / "first")
    return str(first), perturbed_copy(builtin_path, str(root / "second"), seed=1)


@pytest.fixture(scope="module")
def server(spawn_module_server, checkpoints):
    return spawn_module_server(
        "--model", checkpoints[0], "--max-model-len", "256", "--served-model-name", "m"
    )


def complete(url: str, max_tokens: int) -> str:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, **GREEDY}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def update(url: str, path: str) -> httpx.Response:
    return httpx.post(f"{url}/update_weights_from_disk", json={"model_path": path}, timeout=300)


def waiting(url: str) -> tuple[float, float]:
    """(requests waiting by both gauges' count, generation tokens so far) from /metrics."""
    m = metrics_of(url)
    assert m["vllm:num_requests_waiting"] == m["deltaserve_num_requests_waiting"], m
    return m["vllm:num_requests_waiting"], m["vllm:generation_tokens_total"]


def send_until_held(url: str, send: Callable[[], None], timeout: float = 60.0) -> threading.Thread:
    """Run `send` (one request) in a thread while a running stream holds an update back; return the
    thread once /metrics has counted its request waiting through an engine step (the stream's
    tokens grew meanwhile): held by the update, not just queued for the next step. A request that
    reached the engine before the update runs beside the stream instead, ends, and is sent again."""
    deadline = time.monotonic() + timeout
    while True:
        thread = threading.Thread(target=send)
        thread.start()
        since: float | None = None  # the generation tokens when it was first seen waiting
        while thread.is_alive():
            assert time.monotonic() < deadline, "no request was counted waiting while the update held it"
            count, tokens = waiting(url)
            if count != 1:
                since = None
            elif since is None:
                since = tokens
            elif tokens > since:
                return thread
            time.sleep(0.02)  # the poll's interval, not a wait for the update
        thread.join()


def test_an_update_waits_for_the_running_and_serves_the_new_weights(server, checkpoints) -> None:
    first, second = checkpoints
    old_long, new_short = offline_text(first, LONG), offline_text(second, 8)
    assert offline_text(first, 8) != new_short
    body = {"model": "m", "prompt": PROMPT, "max_tokens": LONG, "stream": True, **GREEDY}
    results: dict[str, object] = {}

    def send_meanwhile() -> None:
        results["sent"] = time.monotonic()
        results["waited"] = complete(server.url, 8)

    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        chunks = [next(line for line in lines if line.startswith("data: "))]  # it is running
        updater = threading.Thread(target=lambda: results.update(update=update(server.url, second)))
        updater.start()
        waiter = send_until_held(server.url, send_meanwhile)
        chunks += [line for line in lines if line.startswith("data: ")]
        done = time.monotonic()
    updater.join(300)
    waiter.join(300)
    assert results["sent"] < done  # sent while the stream ran (else this test tested nothing)
    streamed = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks if c != "data: [DONE]")
    assert streamed == old_long  # the old weights to its end
    reply = results["update"]
    assert isinstance(reply, httpx.Response) and reply.status_code == 200 and reply.json()["success"] is True
    assert results["waited"] == new_short  # held until the update, then the new weights
    assert complete(server.url, 8) == new_short
    assert httpx.get(f"{server.url}/get_model_info").json()["model_path"] == second  # as SGLang says
    update(server.url, first)
    assert complete(server.url, 8) == offline_text(first, 8)
    assert httpx.get(f"{server.url}/get_model_info").json()["model_path"] == first


def test_a_request_held_by_an_update_counts_as_waiting_until_it_runs(server, checkpoints) -> None:
    """While an update waits for a running stream, a request sent meanwhile is held: /metrics
    (vLLM's and deltaserve's gauges) counts it waiting, and once the update lets it in it runs on
    the new weights and nothing waits any more."""
    first, second = checkpoints
    body = {"model": "m", "prompt": PROMPT, "max_tokens": LONG, "stream": True, **GREEDY}
    results: dict[str, Any] = {}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it is running
        updater = threading.Thread(target=lambda: results.update(update=update(server.url, second)))
        updater.start()
        waiter = send_until_held(server.url, lambda: results.update(held=complete(server.url, 8)))
        for _ in lines:
            pass
    updater.join(300)
    waiter.join(300)
    assert results["update"].status_code == 200
    assert results["held"] == offline_text(second, 8)
    after = wait_idle(server.url)
    assert after["vllm:num_requests_waiting"] == after["deltaserve_num_requests_waiting"] == 0
    assert after["vllm:num_requests_running"] == 0
    update(server.url, first)


def test_the_model_card_names_the_checkpoint_served(server, checkpoints) -> None:
    """/v1/models' `root` is the checkpoint whose weights are served, as /get_model_info's
    `model_path` (it stayed the start-up one); the `id` that clients send stays."""
    first, second = checkpoints

    def cards() -> list[dict[str, Any]]:
        listed = httpx.get(f"{server.url}/v1/models").json()["data"]
        return [*listed, httpx.get(f"{server.url}/v1/models/m").json()]

    assert [(c["id"], c["root"]) for c in cards()] == [("m", first)] * 2
    assert update(server.url, second).status_code == 200
    assert [(c["id"], c["root"]) for c in cards()] == [("m", second)] * 2
    assert update(server.url, first).status_code == 200
    assert [(c["id"], c["root"]) for c in cards()] == [("m", first)] * 2


def test_a_checkpoint_of_another_model_or_none_is_a_400(server, checkpoints, tmp_path) -> None:
    first, _ = checkpoints
    before = complete(server.url, 8)
    other = shutil.copytree(first, tmp_path / "other")
    with open(other / "config.json") as f:
        config = json.load(f)
    config["intermediate_size"] = config["intermediate_size"] * 2
    with open(other / "config.json", "w") as f:
        json.dump(config, f)
    for path, words in ((str(other), "intermediate_size"), (str(tmp_path / "absent"), "no checkpoint")):
        reply = update(server.url, path)
        assert reply.status_code == 400
        body = reply.json()
        assert body["success"] is False and words in body["message"]
        assert body["error"]["type"] == "invalid_request_error" and words in body["error"]["message"]
    assert complete(server.url, 8) == before


def test_abort_all_requests_ends_the_running_and_updates_at_once(server, checkpoints) -> None:
    first, second = checkpoints
    old_long = offline_text(first, 240)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 240, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        chunks = [next(line for line in lines if line.startswith("data: "))]  # it is running
        reply = httpx.post(
            f"{server.url}/update_weights_from_disk",
            json={"model_path": second, "abort_all_requests": True},
            timeout=300,
        )
        chunks += [line for line in lines if line.startswith("data: ")]
    assert reply.status_code == 200 and reply.json()["success"] is True
    events = [json.loads(c[6:]) for c in chunks if c != "data: [DONE]"]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert old_long.startswith(streamed) and len(streamed) < len(old_long)  # cut short, old weights
    assert complete(server.url, 8) == offline_text(second, 8)
    update(server.url, first)


def test_weight_versions_label_the_weights_served(server, checkpoints) -> None:
    first, second = checkpoints

    def version() -> str:
        label = httpx.get(f"{server.url}/get_weight_version").json()["weight_version"]
        assert httpx.get(f"{server.url}/get_model_info").json()["weight_version"] == label
        return label

    start = version()
    body = {"model_path": second, "weight_version": "step-2"}
    assert httpx.post(f"{server.url}/update_weights_from_disk", json=body, timeout=300).status_code == 200
    assert version() == "step-2"
    assert complete(server.url, 8) == offline_text(second, 8)
    relabel = httpx.post(f"{server.url}/update_weight_version", json={"new_version": "step-2b"})
    assert relabel.status_code == 200 and relabel.json()["success"] is True
    assert version() == "step-2b" and complete(server.url, 8) == offline_text(second, 8)  # same weights
    update(server.url, first)  # no version given: the label stays
    assert version() == "step-2b"
    httpx.post(f"{server.url}/update_weight_version", json={"new_version": start})


def test_data_parallel_engines_all_take_the_new_weights(spawn_server, checkpoints) -> None:
    """Both engines stage the checkpoint, then both serve it: a batch spread over them gives the
    new weights' tokens for every prompt; another model's checkpoint changes neither."""
    first, second = checkpoints
    dp = spawn_server("--model", first, "--max-model-len", "256", "--served-model-name", "m", "-dp", "2")
    prompts = [f"{PROMPT} number {i}" for i in range(6)]

    def texts(url: str) -> list[str]:
        body = {"model": "m", "prompt": prompts, "max_tokens": 8, **GREEDY}
        choices = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]
        return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]

    def offline(path: str) -> list[str]:
        llm = LLM(path, device="cpu", max_model_len=256)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        return [o.outputs[0].text for o in outs]

    before = texts(dp.url)
    assert before == offline(first)
    other = shutil.copytree(first, os.path.join(os.path.dirname(second), "other-dp"))
    with open(os.path.join(other, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] *= 2
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(config, f)
    assert update(dp.url, other).status_code == 400
    assert texts(dp.url) == before
    assert update(dp.url, second).status_code == 200
    assert texts(dp.url) == offline(second)


def test_a_request_held_by_an_update_is_aborted_by_its_name(server, checkpoints) -> None:
    """/abort_request names a request that waits for an update (held, not yet in the engine): it
    ends as "abort" once the update lets it in, not after all its tokens."""
    first = checkpoints[0]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": LONG, "stream": True, **GREEDY}
    results: dict[str, Any] = {}

    def held() -> None:
        # fewer tokens than the stream's: one sent again (send_until_held) ends while the stream runs
        payload = {"model": "m", "prompt": PROMPT, "max_tokens": 50, "request_id": "held-1", **GREEDY}
        results["held"] = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=300).json()

    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it is running
        updater = threading.Thread(target=lambda: results.update(update=update(server.url, first)))
        updater.start()
        waiter = send_until_held(server.url, held)
        assert httpx.post(f"{server.url}/abort_request", json={"rid": "held-1"}).status_code == 200
        assert waiting(server.url)[0] == 0  # aborted: no longer waiting, though still held for its end
        for _ in lines:
            pass
    updater.join(300)
    waiter.join(300)
    assert results["update"].status_code == 200
    choice = results["held"]["choices"][0]
    assert choice["finish_reason"] == "abort" and results["held"]["usage"]["completion_tokens"] < 50


def test_concurrent_updates_leave_the_label_path_and_weights_of_one(server, checkpoints) -> None:
    """Two updates at once, while a request runs: each answers, and what the server then serves,
    its path and its label all come from the same update (they mixed: one's label on the
    other's weights)."""
    first, second = checkpoints
    texts = {first: offline_text(first, 8), second: offline_text(second, 8)}
    labels = {first: "w-first", second: "w-second"}
    body = {"model": "m", "prompt": PROMPT, "max_tokens": LONG, "stream": True, **GREEDY}
    replies: dict[str, httpx.Response] = {}

    def send(path: str) -> None:
        payload = {"model_path": path, "weight_version": labels[path]}
        replies[path] = httpx.post(f"{server.url}/update_weights_from_disk", json=payload, timeout=300)

    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it is running
        senders = [threading.Thread(target=send, args=(p,)) for p in (second, first)]
        for t in senders:
            t.start()
            time.sleep(0.05)
        for _ in lines:
            pass
    for t in senders:
        t.join(300)
    assert all(r.status_code in (200, 400) for r in replies.values())
    assert any(r.status_code == 200 for r in replies.values())
    info = httpx.get(f"{server.url}/get_model_info").json()
    path = info["model_path"]
    assert info["weight_version"] == labels[path] and complete(server.url, 8) == texts[path]
    assert replies[path].status_code == 200
    update(server.url, first)
