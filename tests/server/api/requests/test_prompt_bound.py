"""A prompt far longer than the context is refused by its length, before it is tokenized: tokenizing
tens of megabytes held the one prompt worker, and every other request's prompt waited behind it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import openai
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from deltaserve.server.api.context import ServerContext
from deltaserve.server.app import build_app
from deltaserve.server.engine_client import EngineClient
from deltaserve.server.text.prompt_bound import chars_per_token

from ...conftest import app_in_thread
from ..outputs.test_scripted_outputs import QWEN3_OUTPUT, ScriptedEngine

# Long prompts tokenized, and a stream held running, to time each refusal against
pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tokenizer(builtin_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_path)


def test_byte_level_bpe_prompts_have_no_more_characters_than_the_bound_allows(tokenizer) -> None:
    bound = chars_per_token(tokenizer)
    assert bound is not None and bound.ascii < bound.other
    texts = [
        " " * 5000,
        "-" * 5000 + "\n",
        "lorem ipsum dolor sit amet " * 200,
        "e\u0301" * 500,  # NFC composes each pair into one character
        "\u03b1\u0313\u0300\u0345" * 300,  # ... and these four into one (U+1F82)
        "\u6f22\u5b57" * 400,
        "<|im_start|>" * 100,
    ]
    for text in texts:
        ids = tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        assert len(text) <= len(ids) * bound.of(text), text[:20]


def test_tokenizers_that_may_drop_text_have_no_bound() -> None:
    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # spaces become no token at all
    stripped = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
    stripped.pre_tokenizer = pre_tokenizers.ByteLevel()
    stripped.normalizer = normalizers.Strip()
    for backend in (word_level, stripped):
        assert chars_per_token(PreTrainedTokenizerFast(tokenizer_object=backend)) is None


@pytest.fixture
def served(tokenizer, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[int]]]:
    """The real app over a stand-in engine of a 256-token context, on a free port; with the lengths
    of the texts the server tokenized and of the token ids it decoded."""
    tokenized: list[int] = []
    encode = ServerContext.encode

    def counted(self: ServerContext, text: str, add_special_tokens: bool = False) -> list[int]:
        tokenized.append(len(text))
        return encode(self, text, add_special_tokens)

    def decoded(self: ServerContext, token_ids: list[int]) -> str:
        tokenized.append(len(token_ids))  # an echoed token-id prompt's length, decoded
        return decode(self, token_ids)

    decode = ServerContext.decode
    monkeypatch.setattr(ServerContext, "encode", counted)
    monkeypatch.setattr(ServerContext, "decode", decoded)
    engine = ScriptedEngine(tokenizer, QWEN3_OUTPUT)
    engine.max_model_len = MAX_MODEL_LEN
    app = build_app(EngineClient.in_thread(engine), model_names=["scripted"])
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(app_in_thread(app, join_s=10))
        yield f"http://127.0.0.1:{port}", tokenized


def test_an_overlong_prompt_is_refused_untokenized_while_a_stream_flows(served, tokenizer) -> None:
    url, tokenized = served
    bound = chars_per_token(tokenizer)
    assert bound is not None
    long = "word " * (MAX_MODEL_LEN * bound.ascii // 5 + 1)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="scripted", prompt="Hi", max_tokens=200, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    bodies = {
        "/v1/completions": ({"model": "scripted", "prompt": long}, "prompt"),
        "/v1/chat/completions": (
            {"model": "scripted", "messages": [{"role": "user", "content": long}]},
            "messages",
        ),
        "/generate": ({"text": ["Hi", long]}, "text"),
    }
    for message in _refused_for_length(url, bodies):
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message
        assert "characters is longer than that" in message
    assert all(n < len(long) for n in tokenized)  # none of them was tokenized
    text += "".join(c.choices[0].text for c in chunks)
    assert text == QWEN3_OUTPUT  # the stream beside them, whole
    # a prompt the request truncates may be longer than the context: it is tokenized and served
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "scripted", "prompt": long, "truncate_prompt_tokens": 8, "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8
    assert max(tokenized) == len(long)


def test_an_overlong_token_id_prompt_is_refused_undecoded(served) -> None:
    """A token-id prompt longer than the context is refused before its ids are scanned or
    decoded for an echo."""
    url, decoded = served
    ids = [100 + i % 1000 for i in range(MAX_MODEL_LEN + 1)]
    bodies = {
        "/v1/completions": ({"model": "scripted", "prompt": ids, "echo": True, "max_tokens": 1}, "prompt"),
        "/generate": ({"input_ids": [[5, 6], ids]}, "input_ids"),
    }
    for message in _refused_for_length(url, bodies):
        assert f"{MAX_MODEL_LEN} tokens, and the prompt has {len(ids)}" in message
    assert decoded == []


def _refused_for_length(url: str, bodies: dict[str, tuple[dict, str]]) -> list[str]:
    """Each body POSTed to its path: a 400 context_length_exceeded naming its param; the messages."""
    messages = []
    for path, (body, param) in bodies.items():
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        messages.append(error["message"])
    return messages
