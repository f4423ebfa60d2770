"""Every error path answers OpenAI error JSON with the right status, and leaves the server serving."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

GOOD = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=60, **kwargs)


def test_malformed_json_is_400(server) -> None:
    r = post(
        server,
        "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_error(r, 400)


@pytest.mark.parametrize(
    "tail,needle",
    [
        (b', "seed": 1' + b"0" * 5000 + b"}", "request body holds an integer of more than 4,300 digits"),
        (b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "request body nests objects and arrays deeper"),
    ],
    ids=["long-integer", "deep-nesting"],
)
def test_valid_json_the_parser_cannot_read_is_a_400_saying_why(server, tail: bytes, needle: str) -> None:
    """FastAPI's own reply was "There was an error parsing the body", which says nothing of what."""
    body = json.dumps({**GOOD, "max_tokens": 1}).encode()[:-1] + tail
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = post(server, path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert needle in error["message"] and "error parsing" not in error["message"], error
    assert_error(
        post(server, "/v1/chat/completions", content=body, headers={"content-type": "application/json"}), 400
    )


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": MODEL_NAME}, "messages"),  # required field missing
        ({**GOOD, "messages": []}, "messages"),
        ({**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, None),
        ({**GOOD, "temperature": "hot"}, "temperature"),
    ],
)
def test_schema_violation_is_400(server, body: dict, param: str | None) -> None:
    err = assert_error(post(server, "/v1/chat/completions", json=body), 400)
    if param is not None:
        assert err["param"].split(".")[0] == param


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("n", 1000),
        ("max_tokens", -1),
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.5),
    ],
)
def test_out_of_range_is_400(server, field: str, value: float) -> None:
    for path, body in (
        ("/v1/chat/completions", dict(GOOD)),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}),
    ):
        body[field] = value
        err = assert_error(post(server, path, json=body), 400, field)
        assert str(value) in err["message"]


def test_unknown_model_is_404(server, client) -> None:
    assert_error(post(server, "/v1/chat/completions", json={**GOOD, "model": "no-such-model"}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_over_long_prompt_is_400_naming_both_numbers(server, max_model_len) -> None:
    prompt = "word " * (max_model_len + 50)
    n_prompt = post(server, "/tokenize", json={"prompt": prompt}).json()["count"]
    err = assert_error(
        post(server, "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4}), 400
    )
    assert str(max_model_len) in err["message"] and str(n_prompt) in err["message"]
    # A prompt that fits but leaves no room for max_tokens names the sum and the limit.
    short = post(server, "/tokenize", json={"prompt": "hello there"}).json()["count"]
    err = assert_error(
        post(
            server,
            "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "hello there", "max_tokens": max_model_len},
        ),
        400,
        "max_tokens",
    )
    assert str(max_model_len) in err["message"] and str(short + max_model_len) in err["message"]


def test_openai_client_raises_bad_request(client) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=-1
        )


def test_bad_token_ids_and_empty_prompt_are_400(server) -> None:
    assert_error(
        post(server, "/v1/completions", json={"model": MODEL_NAME, "prompt": [10**9], "max_tokens": 2}),
        400,
        "prompt",
    )
    assert_error(
        post(server, "/v1/completions", json={"model": MODEL_NAME, "prompt": [], "max_tokens": 2}), 400
    )
    assert_error(post(server, "/detokenize", json={"tokens": [-1]}), 400)


@pytest.mark.parametrize(
    "part,needle",
    [
        # said in no API's part name: the Messages and Responses APIs refuse their image parts alike
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "images are not"),
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "'input_audio'"),
        ({"type": "file", "file": {"file_id": "file-1"}}, "'file'"),
    ],
)
def test_non_text_content_parts_are_400_not_dropped(server, part: dict, needle: str) -> None:
    """A text model cannot read an image, audio or a file: answering as if it were not there would
    answer another question."""
    content = [{"type": "text", "text": "What is in this?"}, part]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {**GOOD, "messages": messages} if path != "/tokenize" else {"messages": messages}
        err = assert_error(post(server, path, json=body), 400, "messages.1.content.1.type")
        assert needle in err["message"]
    assert post(server, "/v1/chat/completions", json=GOOD).status_code == 200


@pytest.mark.parametrize(
    "part,param",
    [({"type": "text"}, "messages.0.content.1.text"), ({"text": "no type"}, "messages.0.content.1.type")],
)
def test_a_content_part_without_its_text_or_type_is_400(server, part: dict, param: str) -> None:
    content = [{"type": "text", "text": "Hi"}, part]
    err = assert_error(
        post(
            server, "/v1/chat/completions", json={**GOOD, "messages": [{"role": "user", "content": content}]}
        ),
        400,
        param,
    )
    assert err["message"]


def test_text_and_refusal_parts_reach_the_prompt(server) -> None:
    """A replayed conversation's parts: text parts and an assistant's refusal part are read."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Tell me a secret."}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot share secrets."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Fine."}, {"type": "text", "text": "Then a joke."}],
        },
    ]
    r = post(server, "/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    text = post(server, "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    for piece in ("Tell me a secret.", "I cannot share secrets.", "Fine.\nThen a joke."):
        assert piece in text, text


def test_the_responses_apis_parts_are_read_as_vllms_chat_reads_them(server) -> None:
    """vLLM's chat takes `input_text` / `output_text` parts as text parts and an `input_image` (its
    `image_url` a URL string) as an image part: the same prompt here, not a 400."""
    responses_style = [
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a secret."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "No.", "annotations": []}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Fine."}, {"type": "text", "text": "A joke."}],
        },
    ]
    chat_style = [
        {**m, "content": [{"type": "text", "text": p["text"]} for p in m["content"]]} for m in responses_style
    ]
    tokens = [
        post(server, "/tokenize", json={"messages": m}).json().get("tokens")
        for m in (responses_style, chat_style)
    ]
    assert tokens[0] is not None and tokens[0] == tokens[1]
    assert post(server, "/v1/chat/completions", json={**GOOD, "messages": responses_style}).status_code == 200
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    content = [{"type": "input_text", "text": "What is in this?"}, image]
    err = assert_error(
        post(
            server, "/v1/chat/completions", json={**GOOD, "messages": [{"role": "user", "content": content}]}
        ),
        400,
        "messages.0.content.1.type",
    )
    assert "images are not" in err["message"]  # this model's refusal of any image, as of an image_url part


def test_unknown_fields_are_ignored(server) -> None:
    r = post(server, "/v1/chat/completions", json={**GOOD, "frobnicate": True, "metadata": {"a": 1}})
    assert r.status_code == 200


COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2}


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/completions", {**COMPLETION, "suffix": " and the end"}, "suffix"),
        ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of"),
        ("/v1/chat/completions", {**GOOD, "modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {**GOOD, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("/v1/chat/completions", {**GOOD, "web_search_options": {}}, None),
        (
            "/v1/chat/completions",
            {**GOOD, "web_search_options": {"search_context_size": "low"}},
            "web_search_options",
        ),
        ("/v1/chat/completions", {**GOOD, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ("/v1/chat/completions", {**GOOD, "function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {**GOOD, "chat_template": "{{ messages }}"}, "chat_template"),
        ("/v1/responses", {**RESPONSE, "background": True}, "background"),
        ("/v1/responses", {**RESPONSE, "prompt": {"id": "pmpt_1"}}, "prompt"),
        ("/v1/responses", {**RESPONSE, "conversation": "conv_1"}, "conversation"),
        ("/v1/responses", {**RESPONSE, "n": 3}, "n"),  # one response is one sample
        ("/v1/responses", {**RESPONSE, "logprobs": True}, "logprobs"),  # the chat endpoint's, no place here
        ("/v1/responses", {**RESPONSE, "use_beam_search": True}, "use_beam_search"),
        # values that change nothing are served
        ("/v1/completions", {**COMPLETION, "suffix": None, "best_of": 1}, None),
        ("/v1/completions", {**COMPLETION, "echo": True, "use_beam_search": False}, None),
        (
            "/v1/chat/completions",
            {**GOOD, "modalities": ["text"], "prediction": {"type": "content", "content": "x"}},
            None,
        ),
        ("/v1/responses", {**RESPONSE, "background": False}, None),
        ("/v1/responses", {**RESPONSE, "n": 1, "logprobs": False, "use_beam_search": False}, None),
    ],
)
def test_fields_that_would_change_the_output_are_400_naming_them(
    server, path: str, body: dict, field: str | None
) -> None:
    r = post(server, path, json=body)
    if field is None:
        assert r.status_code == 200, r.text
        return
    err = assert_error(r, 400, field)
    assert "not supported" in err["message"] and err["message"].startswith(field)


def test_unknown_route_is_404_json(server) -> None:
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)


def test_server_still_answers_after_errors(server) -> None:
    bad = [
        post(
            server, "/v1/chat/completions", content=b"nonsense", headers={"content-type": "application/json"}
        ),
        post(server, "/v1/chat/completions", json={**GOOD, "n": -3}),
    ]
    assert all(r.status_code == 400 for r in bad)
    assert post(server, "/v1/chat/completions", json=GOOD).status_code == 200


@pytest.fixture(scope="module")
def keyed_server(spawn_module_server, builtin_path):
    # An explicit --model with two served names; the key comes from the environment, as a container
    # would pass it.
    return spawn_module_server(
        "--model",
        builtin_path,
        "--served-model-name",
        "tiny",
        "tiny-alias",
        "--max-model-len",
        "256",
        env={"DELTASERVE_API_KEY": "sekrit"},
    )


@pytest.mark.parametrize(
    "method,path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]
)
@pytest.mark.slow
def test_api_key_required_on_v1(keyed_server, method: str, path: str) -> None:
    body = {**GOOD, "model": "tiny"} if "chat" in path else {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    kwargs = {"json": body} if method == "POST" else {}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        assert_error(
            httpx.request(method, f"{keyed_server.url}{path}", headers=headers, timeout=60, **kwargs), 401
        )
    ok = httpx.request(
        method, f"{keyed_server.url}{path}", headers={"Authorization": "Bearer sekrit"}, timeout=60, **kwargs
    )
    assert ok.status_code == 200
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200  # outside /v1: open


@pytest.mark.slow
def test_api_key_and_served_names_with_openai_client(keyed_server) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="sekrit", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny", "tiny-alias"]
    r = good.completions.create(model="tiny-alias", prompt="hi", max_tokens=2)
    assert r.model == "tiny-alias" and r.usage.completion_tokens >= 1  # the name asked for, as vLLM echoes it
    chat = good.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.model == "tiny"
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)


@pytest.mark.slow
def test_model_folder_is_served_by_its_base_name_and_its_path(spawn_server, builtin_path: str) -> None:
    from pathlib import Path

    server = spawn_server("--model", builtin_path + "/", "--max-model-len", "256")
    base = Path(builtin_path).name
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [base]
    for name in (base, builtin_path):
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert r.model == base
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=f"{builtin_path}/elsewhere", prompt="hi", max_tokens=2)


@pytest.mark.slow
def test_bad_requests_do_not_disturb_a_running_one(server) -> None:
    body = {"model": MODEL_NAME, "prompt": "steady", "max_tokens": 120, "ignore_eos": True, "stream": True}
    done: dict[str, list[str]] = {}

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            done["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    reader = threading.Thread(target=stream)
    reader.start()
    for bad in ({"n": 0}, {"max_tokens": -1}, {"prompt": "x" * 5000}, {"model": "nope"}, {"temperature": 9}):
        assert post(server, "/v1/completions", json={**body, "stream": False, **bad}).status_code in (
            400,
            404,
        )
    reader.join(120)
    chunks = [json.loads(line[len("data: ") :]) for line in done["lines"][:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    tokens = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "".join(c["choices"][0]["text"] for c in chunks)}
    ).json()
    assert tokens["count"] > 0 and len(chunks) > 10  # streamed as made, not in one piece


@pytest.mark.slow
def test_full_waiting_queue_is_503(spawn_server, until_idle) -> None:
    server = spawn_server(
        "--max-model-len", "512", "--max-running-requests", "1", "--max-waiting-requests", "1"
    )
    body = {"model": MODEL_NAME, "prompt": "count", "max_tokens": 300, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(
                *[http.post(f"{server.url}/v1/completions", json=body) for _ in range(6)]
            )

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert 503 in statuses and 200 in statuses, statuses
    for r in responses:
        if r.status_code == 503:
            assert_error(r, 503)
        else:
            assert r.json()["usage"]["completion_tokens"] == 300
    until_idle(server.url)
    ok = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    # more samples of a prompt than the engine holds even when idle: never servable, so a 400
    many = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2, "n": 3}, timeout=60)
    err = assert_error(many, 400, "n")
    assert "3 samples" in err["message"]
    two = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2, "n": 2}, timeout=60)
    assert two.status_code == 200 and len(two.json()["choices"]) == 2
    # so with more prompts than it holds, their samples admitted together, or a beam search's beams
    batch = {**body, "prompt": ["one", "two", "three"], "max_tokens": 2}
    assert (
        "3 sequences"
        in assert_error(httpx.post(f"{server.url}/v1/completions", json=batch), 400, "prompt")["message"]
    )
    pairs = {**body, "prompt": ["one", "two"], "max_tokens": 2, "n": 2}
    assert_error(httpx.post(f"{server.url}/v1/completions", json=pairs, timeout=60), 400, "prompt")
    beams = {**body, "max_tokens": 2, "n": 3, "use_beam_search": True}
    assert_error(httpx.post(f"{server.url}/v1/completions", json=beams, timeout=60), 400, "n")
    assert httpx.post(f"{server.url}/v1/completions", json={**batch, "prompt": ["a", "b"]}).status_code == 200
    # the same prompt three times is three prompts, not a prompt's three samples (it named n)
    same = assert_error(
        httpx.post(f"{server.url}/v1/completions", json={**batch, "prompt": ["one"] * 3}), 400
    )
    assert same["param"] == "prompt" and "3 sequences" in same["message"]


@pytest.mark.parametrize(
    "bias,needle",
    [
        ({"abc": 1}, "token ids"),
        ({"-3": 1}, "token ids"),
        ({"999999999": 5}, "999999999"),
    ],
)
def test_bad_logit_bias_is_400(server, bias: dict, needle: str) -> None:
    err = assert_error(post(server, "/v1/chat/completions", json={**GOOD, "logit_bias": bias}), 400)
    assert "logit_bias" in err["message"] and needle in err["message"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": "sometimes", "tools": [TOOL]}, "must be"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [TOOL]}, "not among"),
        (
            {"tool_choice": {"type": "function", "function": {"name": ""}}, "tools": [TOOL]},
            "named tool_choice",
        ),
        ({"tool_choice": {"type": "function", "function": "f"}, "tools": [TOOL]}, "named tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": ["f"]}}, "tools": [TOOL]}, "named"),
    ],
)
def test_bad_tool_choice_is_400(server, extra: dict, needle: str) -> None:
    err = assert_error(post(server, "/v1/chat/completions", json={**GOOD, **extra}), 400)
    assert err["param"] == "tool_choice" and needle in err["message"]


def test_tool_choice_follows_the_templates_tool_call_form() -> None:
    from deltaserve.server.api.request_params import tool_choice_constraint
    from deltaserve.server.errors import APIError
    from deltaserve.server.protocol import ToolDefinition

    tools = [ToolDefinition.model_validate(TOOL)]
    xml = tool_choice_constraint("required", tools, "<tool_call>\n<function=example_function_name>")
    json_form = tool_choice_constraint("required", tools, 'as <tool_call>{"name": ...}</tool_call>')
    assert xml is not None and xml.tool_call_form == "xml"
    assert json_form is not None and json_form.tool_call_form == "json"
    assert json_form.tool_calls == [{"name": "f", "parameters": {"type": "object"}}]
    # a Kimi tokenizer: Kimi's markup, whatever the template shows
    kimi = tool_choice_constraint("required", tools, "a template without tool instructions", kimi=True)
    assert kimi is not None and kimi.tool_call_form == "kimi"
    with pytest.raises(APIError) as info:
        tool_choice_constraint("required", tools, "a template without tool instructions")
    assert (
        info.value.status == 400 and info.value.param == "tool_choice" and "shows none" in info.value.message
    )


@pytest.mark.parametrize(
    "fmt,needle",
    [
        ({"type": "xml"}, "'xml' is not supported"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{oops"}}, "not valid JSON"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}},
            "cannot be compiled",
        ),
    ],
)
def test_bad_response_format_is_400_and_admits_nothing(server, fmt: dict, needle: str) -> None:
    err = assert_error(post(server, "/v1/chat/completions", json={**GOOD, "response_format": fmt}), 400)
    assert needle in err["message"]
    ok = post(server, "/v1/chat/completions", json={**GOOD, "response_format": {"type": "text"}})
    assert ok.status_code == 200


def schema_fields(schema: str) -> list[tuple[str, dict, str]]:
    """(path, body fields, the error's param) for each field a JSON schema can come in as text."""
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return [
        ("/v1/chat/completions", {"guided_json": schema}, "guided_json"),
        ("/v1/completions", {"structured_outputs": {"json": schema}}, "structured_outputs"),
        ("/v1/chat/completions", {"response_format": response_format}, "response_format"),
        ("/generate", {"sampling_params": {"json_schema": schema}}, "sampling_params"),
    ]


LONG_INT_SCHEMA = '{"type": "integer", "maximum": 1' + "0" * 5000 + "}"  # past int()'s 4,300 digits
SURROGATE_SCHEMA = '{"type": "string", "enum": ["\\ud800"]}'  # the escape as text: no surrogate in the body
# (schema, our words, the words that reached the client before: Python's advice, xgrammar's parse error)
UNREADABLE_SCHEMAS = [
    (LONG_INT_SCHEMA, "JSON schema holds an integer of more than 4,300 digits", "sys."),
    (SURROGATE_SCHEMA, "JSON schema holds a lone surrogate", "Check failed"),
]


@pytest.mark.parametrize(
    "path,extra,param,ours,theirs",
    [
        (*field, ours, theirs)
        for schema, ours, theirs in UNREADABLE_SCHEMAS
        for field in schema_fields(schema)
    ],
)
def test_a_schema_text_no_grammar_can_read_is_a_400_in_our_words(
    server, path: str, extra: dict, param: str, ours: str, theirs: str
) -> None:
    base = {"text": "hi"} if path == "/generate" else GOOD if "chat" in path else COMPLETION
    err = assert_error(post(server, path, json={**base, **extra}), 400, param)
    assert ours in err["message"] and theirs not in err["message"], err


GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
MESSAGE = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {**GOOD, "max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {**GOOD, "max_completion_tokens": True}, "max_completion_tokens"),
        ("/v1/chat/completions", {**GOOD, "n": True}, "n"),
        ("/v1/chat/completions", {**GOOD, "seed": False}, "seed"),
        ("/v1/chat/completions", {**GOOD, "logprobs": True, "top_logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {**GOOD, "temperature": True}, "temperature"),
        ("/v1/chat/completions", {**GOOD, "stop_token_ids": [5, True]}, "stop_token_ids"),
        ("/v1/chat/completions", {**GOOD, "logit_bias": {"5": True}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs"),
        ("/v1/completions", {**COMPLETION, "min_tokens": True}, "min_tokens"),
        ("/v1/completions", {**COMPLETION, "prompt": [[1, True]]}, "prompt"),
        ("/v1/responses", {**RESPONSE, "max_output_tokens": True}, "max_output_tokens"),
        ("/v1/responses", {**RESPONSE, "top_k": True}, "top_k"),
        ("/v1/messages", {**MESSAGE, "max_tokens": True}, "max_tokens"),
        ("/v1/messages", {**MESSAGE, "top_k": True}, "top_k"),
        ("/v1/messages", {**MESSAGE, "min_tokens": True}, "min_tokens"),  # the chat endpoint's extra field
        (
            "/generate",
            {**GENERATE, "sampling_params": {"max_new_tokens": True}},
            "sampling_params.max_new_tokens",
        ),
        ("/generate", {**GENERATE, "sampling_params": {"n": True}}, "n"),
        ("/generate", {**GENERATE, "return_logprob": True, "top_logprobs_num": True}, "top_logprobs_num"),
        ("/generate", {**GENERATE, "input_ids": [1, True], "text": None}, "input_ids"),
    ],
)
def test_a_boolean_is_no_number(server, read_metrics, path: str, body: dict, param: str) -> None:
    """JSON true is not 1 (pydantic would read it so): max_tokens true is a 400, not one token."""
    before = read_metrics(server.url)["deltaserve_prompt_tokens_total"]
    r = post(server, path, json=body)
    assert r.status_code == 400, r.text
    if path == "/v1/messages":  # Anthropic's shape, which names the field in its message alone
        assert r.json()["type"] == "error"
        message = r.json()["error"]["message"]
    else:
        message = assert_error(r, 400, param)["message"]
    assert message.startswith(f"{param}: Input should be a valid") and "not a boolean" in message
    assert read_metrics(server.url)["deltaserve_prompt_tokens_total"] == before  # nothing admitted


def test_the_openai_client_gets_a_400_for_a_boolean_max_tokens(client) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens: Input should be a valid integer"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=True
        )
    ok = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert ok.usage is not None and ok.usage.completion_tokens == 1


OTHER_F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "path,body,param",
    [
        (
            "/v1/chat/completions",
            {
                **GOOD,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            },
            "tools.0.function.parameters",
        ),
        (
            "/v1/responses",
            {**RESPONSE, "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
            "tools.0.parameters",  # as this API's flat tools spell it
        ),
        (
            "/v1/messages",
            {**GOOD, "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
            "tools.0.input_schema",
        ),
    ],
)
def test_a_functions_parameters_are_an_object_schema(
    server, read_metrics, path: str, body: dict, param: str
) -> None:
    """A function whose parameters schema is not of type object (its arguments are a JSON object in
    every tool-call form) is a 400 naming it, as OpenAI's and Anthropic's are, and nothing runs."""
    before = read_metrics(server.url)["deltaserve_prompt_tokens_total"]
    r = post(server, path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "type 'object'" in err["message"] and err.get("param", param) == param, err
    assert read_metrics(server.url)["deltaserve_prompt_tokens_total"] == before


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {**GOOD, "tools": [TOOL, OTHER_F]}, "tools"),
        ("/v1/chat/completions", {**GOOD, "tools": [TOOL, OTHER_F], "tool_choice": "required"}, "tools"),
        ("/tokenize", {"model": MODEL_NAME, "messages": GOOD["messages"], "tools": [TOOL, OTHER_F]}, "tools"),
        ("/v1/responses", {**RESPONSE, "tools": [{"type": "function", "name": "f"}] * 2}, "tools"),
        (
            "/v1/chat/completions",
            {**GOOD, "tools": [{"type": "function", "function": {"name": ""}}]},
            "tools.0.function.name",
        ),
    ],
)
def test_tools_need_distinct_names(server, read_metrics, path: str, body: dict, param: str) -> None:
    """Two tools of one name (the second's definition silently won the forced call's grammar) or
    a tool with no name are a 400 naming tools, and nothing runs."""
    before = read_metrics(server.url)["deltaserve_prompt_tokens_total"]
    err = assert_error(post(server, path, json=body), 400, param)
    assert "unique" in err["message"] or "at least 1 character" in err["message"]
    assert read_metrics(server.url)["deltaserve_prompt_tokens_total"] == before


def _nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def test_tool_call_arguments_nested_past_the_renderer_are_a_400_naming_them(server, client) -> None:
    """An earlier turn's call whose arguments (a JSON string or an object) nest deeper than 128
    levels is a 400 naming the arguments, on chat, /tokenize and the Responses API alike, not
    Python's "maximum recursion depth exceeded" naming only `messages`; 128 levels render."""
    deep = "nest objects and arrays deeper than 128 levels"

    def turns(arguments: object) -> list[dict]:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"},
        ]

    for arguments in (json.dumps(_nested(600)), _nested(600), json.dumps(_nested(129))):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL_NAME, messages=turns(arguments), max_tokens=1)
        err = refused.value.body
        assert err["param"] == "messages.1.tool_calls.0.function.arguments", err
        assert f"messages[1].tool_calls[0]: a tool call's arguments {deep}" in err["message"], err
        assert "recursion" not in err["message"], err
        r = post(server, "/tokenize", json={"model": MODEL_NAME, "messages": turns(arguments)})
        assert deep in assert_error(r, 400, "messages.1.tool_calls.0.function.arguments")["message"]
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": json.dumps(_nested(600))}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL_NAME, input=[{"role": "user", "content": "hi"}, call])
    assert f"input[1].arguments: a tool call's arguments {deep}" in refused.value.body["message"]
    for arguments in (json.dumps(_nested(128)), _nested(128)):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=turns(arguments), max_tokens=1)
        assert reply.usage is not None and reply.usage.completion_tokens == 1


def test_tool_schemas_and_template_kwargs_nested_past_the_renderer_are_a_400_naming_them(
    server, client, read_metrics
) -> None:
    """A non-strict tool's parameters, or chat_template_kwargs, nested deeper than 128 levels are a
    400 naming the field on chat, /tokenize, the Responses and Messages APIs, not Python's "maximum
    recursion depth exceeded" naming messages; 128 levels render."""
    deep = "nests objects and arrays deeper than 128 levels"
    before = read_metrics(server.url)["deltaserve_prompt_tokens_total"]
    for levels in (129, 600):
        schema = {"type": "object", "properties": _nested(levels - 1)}
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        kwargs = {"x": _nested(levels - 1)}
        for field, value, param in (
            ("tools", tools, "tools.0.function.parameters"),
            ("chat_template_kwargs", kwargs, "chat_template_kwargs"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(
                    model=MODEL_NAME, messages=GOOD["messages"], max_tokens=1, extra_body={field: value}
                )
            err = refused.value.body
            assert err["param"] == param and deep in err["message"] and "recursion" not in err["message"], err
            r = post(
                server, "/tokenize", json={"model": MODEL_NAME, "messages": GOOD["messages"], field: value}
            )
            assert deep in assert_error(r, 400, param)["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(
                model=MODEL_NAME, input="hi", tools=[{"type": "function", "name": "f", "parameters": schema}]
            )
        assert refused.value.body["param"] == "tools.0.parameters" and deep in refused.value.body["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL_NAME, input="hi", extra_body={"chat_template_kwargs": kwargs})
        assert refused.value.body["param"] == "chat_template_kwargs" and deep in refused.value.body["message"]
        anthropic_tool = {"name": "f", "input_schema": schema}
        r = post(server, "/v1/messages", json={**GOOD, "tools": [anthropic_tool]})
        assert r.status_code == 400 and "tools[0].input_schema" in r.json()["error"]["message"], r.text
        assert deep in r.json()["error"]["message"]
    assert read_metrics(server.url)["deltaserve_prompt_tokens_total"] == before
    schema = {"type": "object", "properties": _nested(127)}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    for field, value in (("tools", tools), ("chat_template_kwargs", {"x": _nested(127)})):
        r = post(server, "/tokenize", json={"model": MODEL_NAME, "messages": GOOD["messages"], field: value})
        assert r.status_code == 200, r.text


def test_an_unknown_models_or_responses_id_is_quoted_cut_short(server, client) -> None:
    """A 404 for an unknown model or stored response quotes the id's first 100 characters and its
    length, not the whole id: a megabyte of model name was a megabyte of error."""
    long_id = "m" * 1_000_000
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model=long_id, messages=GOOD["messages"], max_tokens=1)
    message = missing.value.body["message"]
    assert f"'{'m' * 100}'... (1000000 characters)" in message and len(message) < 400, message[:400]
    r = post(server, "/v1/completions", json={"model": long_id, "prompt": "hi", "max_tokens": 1})
    assert len(assert_error(r, 404, "model")["message"]) < 400
    r = httpx.get(f"{server.url}/v1/models/{'m' * 5000}", timeout=60)
    assert "(5000 characters)" in assert_error(r, 404, "model")["message"] and len(r.content) < 600
    r = httpx.get(f"{server.url}/v1/responses/resp_{'x' * 5000}", timeout=60)
    assert "(5005 characters)" in assert_error(r, 404, "response_id")["message"] and len(r.content) < 600
    r = post(server, "/v1/responses", json={**RESPONSE, "previous_response_id": "resp_" + "x" * 1_000_000})
    assert "(1000005 characters)" in assert_error(r, 400, "previous_response_id")["message"]
    assert len(r.content) < 800
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=GOOD["messages"], max_tokens=1)
    assert "'no-such-model' does not exist" in missing.value.body["message"]


def test_a_weight_version_label_is_at_most_256_characters(server) -> None:
    """/update_weight_version's label (and /update_weights_from_disk's) is a 400 naming it past
    256 characters, and the label served stays; one of 256 is taken and reported back."""
    start = httpx.get(f"{server.url}/get_weight_version").json()["weight_version"]
    assert_error(post(server, "/update_weight_version", json={"new_version": "v" * 257}), 400, "new_version")
    body = {"model_path": "/nonexistent", "weight_version": "v" * 1_000_000}
    assert_error(post(server, "/update_weights_from_disk", json=body), 400, "weight_version")
    assert httpx.get(f"{server.url}/get_weight_version").json()["weight_version"] == start
    try:
        assert post(server, "/update_weight_version", json={"new_version": "v" * 256}).status_code == 200
        assert httpx.get(f"{server.url}/get_weight_version").json()["weight_version"] == "v" * 256
    finally:
        assert post(server, "/update_weight_version", json={"new_version": start}).status_code == 200


def test_a_clients_name_for_its_request_is_at_most_256_characters(server, client) -> None:
    """vLLM's request_id, SGLang's rid and the X-Request-Id header name a request, and every chunk
    of its stream repeats the name in its id: one past 256 characters is a 400 naming it (a
    megabyte of request_id made each streamed token a megabyte), on every endpoint that takes one."""
    long, most = "r" * 257, "r" * 256
    chat = {**GOOD, "max_tokens": 1}
    for field in ("request_id", "rid"):
        assert_error(post(server, "/v1/chat/completions", json={**chat, field: long}), 400, field)
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, field: long}
        assert_error(post(server, "/v1/completions", json=body), 400, field)
    for rid in (long, [long]):
        body = {
            "text": ["hi"] if isinstance(rid, list) else "hi",
            "rid": rid,
            "sampling_params": {"max_new_tokens": 1},
        }
        r = post(server, "/generate", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("rid"), r.text
    header = {"X-Request-Id": long}
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", RESPONSE)):
        err = assert_error(post(server, path, json=body, headers=header), 400)
        assert "X-Request-Id" in err["message"] and "256" in err["message"], err
    r = post(server, "/v1/messages", json={**GOOD, "max_tokens": 1}, headers=header)
    assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"], r.text
    named = client.chat.completions.create(
        model=MODEL_NAME, messages=GOOD["messages"], max_tokens=1, extra_body={"request_id": most}
    )
    assert named.id == f"chatcmpl-{most}"
    r = post(server, "/v1/chat/completions", json=chat, headers={"X-Request-Id": most})
    assert r.status_code == 200 and r.json()["id"] == f"chatcmpl-{most}", r.text


def test_a_long_name_an_error_quotes_is_cut_short(server) -> None:
    """An unknown tool_choice name, logit_bias key, or input_items query value is quoted by its
    first 100 characters and its length, as an unknown model is, not echoed whole."""
    long = "z" * 1_000_000
    cut = f"'{'z' * 100}'... (1000000 characters)"
    choice = {"type": "function", "function": {"name": long}}
    for body, param in (
        ({**GOOD, "tools": [TOOL], "tool_choice": choice}, "tool_choice"),
        ({**GOOD, "logit_bias": {long: 1}}, "logit_bias"),
    ):
        r = post(server, "/v1/chat/completions", json=body)
        assert cut in assert_error(r, 400, param)["message"] and len(r.content) < 600, r.text[:600]
    stored = post(server, "/v1/responses", json=RESPONSE).json()["id"]
    for query, param in (("after", "after"), ("order", "order"), ("include", "include")):
        r = httpx.get(
            f"{server.url}/v1/responses/{stored}/input_items", params={query: "z" * 5000}, timeout=60
        )
        assert "(5000 characters)" in assert_error(r, 400, param)["message"] and len(r.content) < 600, r.text[
            :600
        ]
