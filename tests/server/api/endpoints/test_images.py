"""Images in chat messages (OpenAI's image_url parts) on a real server over a tiny Qwen3.5
vision-language checkpoint, through the openai client: the reply is the offline engine's for the
same prompt and image, whether the image comes as a data URL or over HTTP, streamed or not; images
the server cannot read are 400s that leave it serving."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading
import time

import numpy as np
import openai
import pytest

from deltaserve import LLM, SamplingParams

# A vision server of its own and offline runs to compare (tests/models/test_image_input.py stays fast)
pytestmark = pytest.mark.slow

PIL = pytest.importorskip("PIL.Image")


def png(value: int, size: tuple[int, int] = (24, 16)) -> bytes:
    rng = np.random.default_rng(value)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8) // 2 + value // 2
    buf = io.BytesIO()
    PIL.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def solid_png(value: int) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(np.full((32, 32, 3), value, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def huge_png(width: int = 20_000, height: int = 10_000) -> bytes:
    """A PNG whose header claims more pixels than PIL will decode (a decompression bomb)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def conversation(*urls: str) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": "w1 w2 w3"}]
    for url in urls:
        parts += [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w4"}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def vision_server(spawn_module_server, vision_checkpoint):
    return spawn_module_server(
        "--model",
        vision_checkpoint,
        "--tokenizer",
        f"{vision_checkpoint}/tokenizer",
        "--max-model-len",
        "256",
        "--served-model-name",
        "vl",
    )


@pytest.fixture(scope="module")
def vl(vision_server):
    with openai.OpenAI(base_url=f"{vision_server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def image_host():
    """A loopback HTTP server handing out PNGs by their seed: /7.png."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            name = self.path.strip("/")
            if not name.endswith(".png"):
                self.send_error(404)
                return
            slow = name.startswith("slow-")  # a byte each 0.2 s: no read waits long, the whole does
            body = png(int(name.removeprefix("slow-")[:-4]))
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(len(body)) if slow else []:
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                time.sleep(0.2)
            if not slow:
                self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@functools.cache
def offline(path: str) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_model_len=256, tokenizer=f"{path}/tokenizer")


def offline_reply(path: str, messages: list[dict], images: list[bytes], n: int) -> tuple[str, int]:
    """The offline engine's text and prompt length for the chat, rendered by the same template."""
    llm = offline(path)
    ids = llm.tokenizer.apply_chat_template(
        [{"role": m["role"], "content": [_template_part(p) for p in m["content"]]} for m in messages],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
    pil = [PIL.open(io.BytesIO(b)) for b in images]
    out = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": pil}},
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
    )[0]
    return out.outputs[0].text, len(out.prompt_token_ids)


def _template_part(part: dict) -> dict:
    return {"type": "image"} if part["type"] == "image_url" else part


GREEDY = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def test_an_image_reply_is_the_offline_engines(vision_server, vl, vision_checkpoint, image_host) -> None:
    one, two = png(1), png(200, (40, 32))
    messages = conversation(data_url(one), data_url(two))
    reply = vl.chat.completions.create(model="vl", messages=messages, **GREEDY)
    text, prompt_len = offline_reply(vision_checkpoint, messages, [one, two], 6)
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_len  # each image's tokens counted
    stream = vl.chat.completions.create(model="vl", messages=messages, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    by_data = vl.chat.completions.create(
        model="vl", messages=conversation(data_url(png(1)), data_url(png(7))), **GREEDY
    )
    fetched = vl.chat.completions.create(
        model="vl", messages=conversation(f"{image_host}/1.png", f"{image_host}/7.png"), **GREEDY
    )
    assert fetched.choices[0].message.content == by_data.choices[0].message.content
    assert fetched.usage.prompt_tokens == by_data.usage.prompt_tokens


def test_tokenize_counts_each_images_tokens(vision_server, vl) -> None:
    """/tokenize with messages gives the prompt the chat endpoint runs: each image's placeholder
    expanded to its tokens, so a client can measure the prompt against the context."""
    import httpx

    messages = conversation(data_url(png(1)), data_url(png(200, (40, 32))))
    reply = vl.chat.completions.create(model="vl", messages=messages, **GREEDY)
    ids = httpx.post(f"{vision_server.url}/tokenize", json={"messages": messages}, timeout=60).json()
    assert ids["count"] == len(ids["tokens"]) == reply.usage.prompt_tokens
    bare = httpx.post(f"{vision_server.url}/tokenize", json={"messages": conversation()}, timeout=60).json()
    assert ids["count"] > bare["count"] + 2  # more than a placeholder an image


def test_n_choices_of_an_image_prompt_share_its_warm_up(vision_server, vl, vision_checkpoint) -> None:
    """A prompt with an image, two pages long, sampled n > 1 times: the prefill that warms it for
    the choices reads its image, so the choices start from the cache (the warm-up read the prompt
    as text, which no choice matched: each prefilled it whole); each reply is the offline one."""
    image = png(33, (40, 32))
    text = {"type": "text", "text": "w1 w2 w3 " * 8}
    messages = [
        {"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": data_url(image)}}]}
    ]
    want, prompt_len = offline_reply(vision_checkpoint, messages, [image], 6)
    assert prompt_len >= 32  # two pages: warmed before its choices run
    # greedy choices: top_k 1 at a positive temperature (n > 1 at temperature 0 is a 400, as in vLLM)
    choices = {**GREEDY, "temperature": 1.0, "extra_body": {"ignore_eos": True, "top_k": 1}}
    reply = vl.chat.completions.create(model="vl", messages=messages, n=3, **choices)
    assert [c.message.content for c in reply.choices] == [want] * 3
    assert reply.usage.prompt_tokens == prompt_len
    assert (
        reply.usage.prompt_tokens_details is not None and reply.usage.prompt_tokens_details.cached_tokens > 0
    )
    # an image last: the prompt less its last token would cut it, and is not warmed
    import httpx

    llm = offline(vision_checkpoint)
    ids = llm.tokenizer.encode("w1 w2 w3 " * 12) + [llm.engine.admission.images.image_token_id]
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "n": 2}
    body = {"input_ids": ids, "image_data": data_url(image), "sampling_params": sampling}
    replies = httpx.post(f"{vision_server.url}/generate", json=body, timeout=60)
    assert replies.status_code == 200, replies.text
    assert len(replies.json()) == 2 and replies.json()[0]["text"] == replies.json()[1]["text"]


def test_images_change_the_reply(vl) -> None:
    replies = {
        vl.chat.completions.create(model="vl", messages=conversation(data_url(solid_png(v))), **GREEDY)
        .choices[0]
        .message.content
        for v in (0, 255)
    }
    assert len(replies) == 2


@pytest.mark.parametrize(
    "url, words",
    [
        ("data:image/png;base64,not-base64!", "base64"),
        (data_url(b"not an image"), "could not be read"),
        (data_url(huge_png()), "decompression bomb"),
        ("ftp://example.com/a.png", "must be a data: URL"),
        ("http://127.0.0.1:9/absent.png", "fetching"),
        ("http://[::1/a.png", "fetching"),  # a URL httpx cannot parse: InvalidURL, no HTTPError
    ],
)
def test_a_bad_image_is_a_400_and_the_server_serves_on(vl, url: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError, match=words):
        vl.chat.completions.create(model="vl", messages=conversation(url), **GREEDY)
    ok = vl.chat.completions.create(model="vl", messages=conversation(data_url(png(3))), **GREEDY)
    assert ok.choices[0].finish_reason == "length"


def test_a_text_model_refuses_images(client) -> None:
    with pytest.raises(openai.BadRequestError, match="reads text only") as err:
        client.chat.completions.create(
            model=client.models.list().data[0].id, messages=conversation(data_url(png(1))), **GREEDY
        )
    assert err.value.body["param"] == "messages.0.content.1.type"  # the image part


def test_the_image_limit_and_a_template_without_images_are_400s() -> None:
    from deltaserve.models.vision.processor import ImageProcessor
    from deltaserve.server.api.images import ImageReader
    from deltaserve.server.errors import APIError

    reader = ImageReader(ImageProcessor(), 150, limit=1)
    reader.check(1, "messages")
    with pytest.raises(APIError, match="at most 1 a prompt"):
        reader.check(2, "messages")
    with pytest.raises(APIError, match="does the chat template write images"):
        reader.expand([1, 2, 3], ImageProcessor()([PIL.new("RGB", (64, 64))]))
    with pytest.raises(APIError, match="reads text only"):
        ImageReader().check(1, "messages")


def test_responses_and_messages_read_images_as_chat_does(vision_server, vl) -> None:
    import httpx

    image = png(5)
    chat = vl.chat.completions.create(model="vl", messages=conversation(data_url(image)), **GREEDY)
    response = vl.responses.create(
        model="vl",
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "w1 w2 w3"},
            {"type": "input_image", "image_url": data_url(image)},
            {"type": "input_text", "text": "w4"},
        ]}],
        max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    source = {"type": "base64", "media_type": "image/png", "data": data_url(image).split(",", 1)[1]}
    body = {"model": "vl", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "w1 w2 w3"}, {"type": "image", "source": source}, {"type": "text", "text": "w4"},
        ]}]}  # fmt: skip
    message = httpx.post(f"{vision_server.url}/v1/messages", json=body, timeout=60).json()
    assert message["content"][0]["text"] == chat.choices[0].message.content
    assert (
        message["usage"]["input_tokens"] + message["usage"].get("cache_read_input_tokens", 0)
        == chat.usage.prompt_tokens
    )
    with pytest.raises(openai.BadRequestError, match="file_id is not supported"):
        vl.responses.create(
            model="vl", input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]
        )


def test_a_tool_results_images_are_read_as_a_tool_messages(vision_server, vl) -> None:
    """An Anthropic tool_result holding text and an image (as a tool that reads a screenshot gives
    it) is the chat tool message with those parts: the same prompt and reply."""
    import httpx

    image = png(6)
    call = {"id": "toolu_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    chat = vl.chat.completions.create(
        model="vl",
        messages=[
            {"role": "user", "content": "w1"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": [
                {"type": "text", "text": "w2"}, {"type": "image_url", "image_url": {"url": data_url(image)}},
            ]},
        ],
        **GREEDY,
    )  # fmt: skip
    source = {"type": "base64", "media_type": "image/png", "data": data_url(image).split(",", 1)[1]}
    body = {"model": "vl", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "messages": [
        {"role": "user", "content": "w1"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "w2"}, {"type": "image", "source": source},
        ]}]},
    ]}  # fmt: skip
    reply = httpx.post(f"{vision_server.url}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["content"][0]["text"] == chat.choices[0].message.content
    usage = message["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat.usage.prompt_tokens


PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # the template's for one image; id 150 the pad


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"w1 {PLACEHOLDER} w2"}]}, "messages"),
        # with an image, the text's placeholder would take the image's place, or be one too many
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": f"w1 {PLACEHOLDER}"},
            {"type": "image_url", "image_url": {"url": data_url(png(2))}},
        ]}]}, "messages"),
        ("/v1/completions", {"prompt": f"w1 {PLACEHOLDER} w2"}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [1, 152, 150, 153, 2]]}, "prompt"),
        ("/v1/responses", {"input": f"w1 {PLACEHOLDER}", "max_output_tokens": 3}, "input"),
        ("/v1/messages", {"messages": [{"role": "user", "content": f"w1 {PLACEHOLDER}"}]}, None),
        ("/generate", {"input_ids": [1, 152, 150, 153, 2]}, "input_ids"),  # no image_data for it
        ("/generate", {"text": f"w1 {PLACEHOLDER}"}, "text"),
    ],
)  # fmt: skip
def test_an_image_placeholder_without_its_image_is_a_400(
    vision_server, vl, read_metrics, path: str, body: dict, param: str | None
) -> None:
    """The image placeholder token in a prompt's text or ids, beyond the images sent: refused
    (it went to the model as a token it never read, or took the place of an image)."""
    import httpx

    before = read_metrics(vision_server.url)["deltaserve_prompt_tokens_total"]
    r = httpx.post(f"{vision_server.url}{path}", json={"model": "vl", "max_tokens": 3, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "image placeholder token" in error["message"]
    if param is not None:
        assert error["param"] == param
    assert read_metrics(vision_server.url)["deltaserve_prompt_tokens_total"] == before
    ok = vl.chat.completions.create(model="vl", messages=conversation(data_url(png(2))), **GREEDY)
    assert ok.choices[0].finish_reason == "length"


def test_sglang_generate_reads_image_data(vision_server, vision_checkpoint) -> None:
    """SGLang's /generate with image_data (a data URL, or bare base64) and a prompt holding one
    placeholder an image: the offline engine's tokens, each image's tokens counted; a batch takes a
    list a prompt."""
    import httpx

    messages = conversation(data_url(png(1)))
    text, prompt_len = offline_reply(vision_checkpoint, messages, [png(1)], 6)
    llm = offline(vision_checkpoint)
    ids = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [_template_part(p) for p in messages[0]["content"]]}],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    raw = base64.b64encode(png(1)).decode()
    for image in (data_url(png(1)), raw):
        body = {"input_ids": ids, "image_data": image, "sampling_params": sampling}
        reply = httpx.post(f"{vision_server.url}/generate", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["text"] == text and reply.json()["meta_info"]["prompt_tokens"] == prompt_len
    other, _ = offline_reply(vision_checkpoint, conversation(data_url(png(9))), [png(9)], 6)
    batch = {"input_ids": [ids, ids], "image_data": [[raw], data_url(png(9))], "sampling_params": sampling}
    replies = httpx.post(f"{vision_server.url}/generate", json=batch, timeout=60).json()
    assert [r["text"] for r in replies] == [text, other]
    bad = {"input_ids": ids, "image_data": "not base64!", "sampling_params": sampling}
    reply = httpx.post(f"{vision_server.url}/generate", json=bad, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "image_data"


def test_a_fetch_that_trickles_past_the_deadline_is_refused(image_host, monkeypatch) -> None:
    """The fetch's time limit bounds the whole download, not each read."""
    import asyncio

    from deltaserve.server.api import images

    monkeypatch.setattr(images, "FETCH_TIMEOUT_S", 1.0)
    start = time.monotonic()
    with pytest.raises(ValueError, match="took over 1 s"):
        asyncio.run(images.fetch(f"{image_host}/slow-3.png"))
    # ended at the deadline, the download cancelled: the whole trickle (1,236 bytes) takes over 4 minutes
    assert time.monotonic() - start < 30
    assert asyncio.run(images.fetch(f"{image_host}/3.png")) == png(3)
