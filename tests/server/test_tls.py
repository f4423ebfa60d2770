"""HTTPS, as vLLM's --ssl-* flags give it: a real server with the test CA's certificate
(tests/server/tls), mutual TLS, behind a path prefix (--root-path), answered through the official
openai client; and start-up refusing what cannot work."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

# Servers of its own, started over TLS
pytestmark = pytest.mark.slow

TLS = Path(__file__).parent / "tls"
KEY = "sk-tls-test"


def context(client_cert: bool) -> ssl.SSLContext:
    """What a client trusts (the test CA) and, for mutual TLS, the certificate it shows."""
    ctx = ssl.create_default_context(cafile=str(TLS / "ca.pem"))
    if client_cert:
        ctx.load_cert_chain(str(TLS / "client.pem"), str(TLS / "client-key.pem"))
    return ctx


@pytest.fixture(scope="module")
def https_server(spawn_module_server):
    return spawn_module_server(
        "--max-model-len", "256",
        "--api-server-count", "2",  # each HTTP process serves TLS on the shared port
        "--ssl-keyfile", str(TLS / "server-key.pem"),
        "--ssl-certfile", str(TLS / "server.pem"),
        "--ssl-ca-certs", str(TLS / "ca.pem"),
        "--ssl-cert-reqs", "2",
        "--root-path", "/llm",
        "--api-key", KEY,
        tls=context(client_cert=True),
    )  # fmt: skip


def test_the_openai_client_streams_over_mutual_tls(https_server) -> None:
    import openai

    assert https_server.url.startswith("https://")
    with (
        httpx.Client(verify=context(client_cert=True)) as http,
        openai.OpenAI(
            base_url=f"{https_server.url}/v1", api_key=KEY, http_client=http, max_retries=0
        ) as client,
    ):
        messages = [{"role": "user", "content": "Hello"}]
        whole = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        chunks = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.usage.completion_tokens == 6 and streamed == whole.choices[0].message.content


def test_clients_the_server_does_not_accept_are_refused(https_server) -> None:
    with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
        httpx.get(f"{https_server.url}/health", verify=context(client_cert=False), timeout=10)
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the server's CA
        httpx.get(f"{https_server.url}/health", timeout=10)
    plain = https_server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
        httpx.get(f"{plain}/health", timeout=10)
    assert httpx.get(f"{https_server.url}/health", verify=context(client_cert=True)).status_code == 200


def test_root_path_names_the_prefix_and_the_key_still_guards_the_routes(https_server) -> None:
    """Behind a proxy that serves the API at /llm and strips the prefix: the OpenAPI document
    names it, the routes answer, and the API key guards them as without a prefix."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(verify=context(client_cert=True), timeout=30) as http:
        spec = http.get(f"{https_server.url}/openapi.json").json()
        assert spec["servers"] == [{"url": "/llm"}]
        models = http.get(f"{https_server.url}/v1/models", headers=auth)
        assert [m["id"] for m in models.json()["data"]] == [MODEL_NAME]
        for path in ("/v1/models", "/tokenize"):
            assert (
                http.request(
                    "GET" if path == "/v1/models" else "POST", f"{https_server.url}{path}"
                ).status_code
                == 401
            )


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltaserve", "serve", *args], capture_output=True, text=True, timeout=120
    )


def test_a_key_that_is_not_the_certificates_stops_start_up_with_one_line() -> None:
    result = serve("--ssl-keyfile", str(TLS / "client-key.pem"), "--ssl-certfile", str(TLS / "server.pem"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert (
        lines[-1].startswith("deltaserve serve: error: cannot serve HTTPS")
        and "Traceback" not in result.stderr
    )
    assert "Loading" not in result.stderr  # before the model
