"""Browsers' cross-origin calls (CORS), as vLLM and SGLang allow them: any origin by default, the
preflight answered before the API key is asked for, errors readable by the page, and
`--allowed-origins` narrowing who may call."""

from __future__ import annotations

import httpx
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME
from deltaserve.server.cli import build_parser

BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PAGE = "https://chat.example"


def preflight(url: str, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return httpx.options(f"{url}/v1/chat/completions", headers=headers, timeout=30)


def test_any_origin_may_call_by_default(server) -> None:
    answer = preflight(server.url, PAGE)
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == "*"
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    r = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, headers={"Origin": PAGE}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    streamed = {**BODY, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=streamed, headers={"Origin": PAGE}, timeout=60
    ) as s:
        assert s.headers["access-control-allow-origin"] == "*"
        assert "data: [DONE]" in s.read().decode()
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=60)  # no Origin: no CORS
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


@pytest.mark.slow
def test_the_preflight_needs_no_key_and_a_refusal_is_readable(spawn_server) -> None:
    server = spawn_server("--api-key", "sesame", "--max-model-len", "256")
    assert preflight(server.url, PAGE).status_code == 200
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, headers={"Origin": PAGE}, timeout=60)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert refused.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.slow
def test_allowed_origins_narrow_who_may_call(spawn_server) -> None:
    server = spawn_server("--allowed-origins", f'["{PAGE}"]', "--max-model-len", "256")
    allowed = preflight(server.url, PAGE)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == PAGE
    assert preflight(server.url, "https://elsewhere.example").status_code == 400
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json=BODY,
        headers={"Origin": "https://elsewhere.example"},
        timeout=60,
    )
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # the browser hides it


def test_cors_flags_take_json_lists() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--allowed-origins", "[]", "--allowed-methods", '["GET", "POST"]'])
    assert args.allowed_origins == [] and args.allowed_methods == ["GET", "POST"]
    assert args.allowed_headers is None and args.allow_credentials is False
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--allowed-origins", bad])
