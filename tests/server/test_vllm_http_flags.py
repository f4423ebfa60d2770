"""vLLM's flags that a `vllm serve` command line carries and that change what the server answers:
--disable-fastapi-docs, --enable-request-id-headers, --enable-force-include-usage,
--chat-template-content-format and --skip-tokenizer-init, on a real server through the official openai client."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

pytestmark = pytest.mark.slow  # a server of its own
# shows how each message's content reached it: a string as S(...), a list as its parts
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% if m.content is string %}S({{ m.content }})"
    "{% else %}{% for p in m.content %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% endif %}|{% endfor %}"
)


@pytest.fixture(scope="module")
def url(spawn_module_server) -> str:
    return spawn_module_server(
        "--max-model-len", "256",
        "--disable-fastapi-docs", "--enable-request-id-headers", "--enable-force-include-usage",
        "--chat-template", PARTS_TEMPLATE, "--chat-template-content-format", "openai",
    ).url  # fmt: skip


@pytest.fixture
def oai(url: str):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_disable_fastapi_docs_leaves_no_docs_or_schema(url: str) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 404, path
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # the rest is served


def test_request_id_headers_come_on_every_response(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}]
    raw = oai.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert re.fullmatch(r"[0-9a-f]{32}", raw.headers["x-request-id"]), raw.headers
    again = oai.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert again.headers["x-request-id"] != raw.headers["x-request-id"]  # a fresh one each time
    named = oai.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=messages, max_tokens=2, extra_headers={"X-Request-Id": "mine-1"}
    )
    assert named.headers["x-request-id"] == "mine-1" and named.parse().id == "chatcmpl-mine-1"
    models = oai.models.with_raw_response.list()  # any route, not only generation
    assert re.fullmatch(r"[0-9a-f]{32}", models.headers["x-request-id"])


def test_force_include_usage_ends_every_stream_with_usage(oai: openai.OpenAI) -> None:
    chat = list(
        oai.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    last = chat[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 3 and last.usage.prompt_tokens > 0
    assert all(c.usage is None for c in chat[:-1])  # at the end only: not continuous usage
    text = list(
        oai.completions.create(
            model=MODEL_NAME, prompt="Hello", max_tokens=2, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert text[-1].choices == [] and text[-1].usage is not None
    assert text[-1].usage.completion_tokens == 2
    # a client that asks for no usage still gets it, as vLLM's flag does
    off = list(
        oai.completions.create(
            model=MODEL_NAME,
            prompt="Hello",
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": False},
            extra_body={"ignore_eos": True},
        )
    )
    assert off[-1].usage is not None and off[-1].usage.total_tokens == off[-1].usage.prompt_tokens + 2


def test_skip_tokenizer_init_serves_token_ids_alone(spawn_server) -> None:
    server = spawn_server("--max-model-len", "256", "--skip-tokenizer-init")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as oai:
        out = oai.completions.create(
            model=MODEL_NAME, prompt=[3, 17, 42, 5], max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == "" and out.usage is not None
        assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError, match="without a tokenizer"):
            oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="without a tokenizer"):
            oai.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)


def test_content_format_openai_gives_the_template_lists_of_parts(url: str, oai: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
    ]
    tokens = httpx.post(f"{url}/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=30)
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"model": MODEL_NAME, "tokens": ids}, timeout=30).json()[
        "prompt"
    ]
    assert text == "system:[text:be brief]|user:[text:one][text:two]|"  # auto: S(be brief), S(one\ntwo)
    out = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
