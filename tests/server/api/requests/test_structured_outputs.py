"""Structured outputs through the HTTP server: what a schema, regex or grammar promises holds for
the built-in model's random weights (the grammar alone decides the text), and a request the
grammar machinery cannot serve is a 400 naming its field while the server goes on serving."""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

import httpx
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME


def chat(base_url: str, **fields) -> httpx.Response:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "JSON"}],
        "max_tokens": 24,
        **fields,
    }
    return httpx.post(f"{base_url}/chat/completions", json=body, timeout=60)


def nested(depth: int) -> str:
    """The text of a schema of arrays of arrays ... of integers, `depth` objects deep."""
    return (
        '{"type": "array", "maxItems": 1, "items": ' * (depth - 1) + '{"type": "integer"}' + "}" * (depth - 1)
    )


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": json.loads(nested(600))},
                }
            },
            "response_format",
        ),
        # as text, nested past what Python's JSON parser follows
        ({"guided_json": nested(3000)}, "guided_json"),
    ],
    ids=["object", "text"],
)
def test_a_schema_nested_too_deeply_is_a_400(base_url, fields, param) -> None:
    """A schema nested hundreds of levels deep could not be sent to the engine (or parsed): it was
    a 500 'internal error'; now a 400 that says why, and the server answers the next request."""
    r = chat(base_url, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "deeper than 128 levels" in err["message"]
    ok = chat(
        base_url,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": json.loads(nested(100))},
        },
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


TAB = 197  # the Qwen tokenizer's "\t"
NOTE = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 2, "maxLength": 8}},
    "required": ["note"],
    "additionalProperties": False,
}


def pushed_reply(client, schema: dict[str, Any], token: int, name: str) -> Any:
    """A greedy reply held to `schema`, every step pushed towards `token`: where the grammar lets
    a token through that breaks JSON (a raw tab in a string), this is where it shows."""
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=30,
        temperature=0,
        logit_bias={str(token): 100},
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    ).choices[0]


@pytest.mark.parametrize(
    "spec, key",
    [
        ({"name": "s", "strict": "x"}, "strict"),
        ({"name": 5}, "name"),
        ({"name": "s", "description": ["d"]}, "description"),
        ({}, "name"),
    ],
)
def test_a_json_schema_without_a_name_or_with_a_field_of_another_type_is_a_400(base_url, spec, key) -> None:
    """OpenAI's and vLLM's schemas require a string name and take a string description and a
    boolean strict; another value, or no name, is refused, not ignored, on chat and (as
    text.format) on the Responses API."""
    schema = {"type": "object"}
    r = chat(base_url, response_format={"type": "json_schema", "json_schema": {**spec, "schema": schema}})
    responses = httpx.post(
        f"{base_url}/responses",
        json={
            "input": "JSON",
            "max_output_tokens": 8,
            "text": {"format": {"type": "json_schema", **spec, "schema": schema}},
        },
        timeout=60,
    )
    for reply, param in ((r, "response_format"), (responses, "text.format")):
        assert reply.status_code == 400, reply.text
        assert set(reply.json()) == {"error"}
        err = reply.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param and key in err["message"] and param in err["message"], err
    good = {"name": "s", "description": "d", "strict": True, "schema": schema}
    assert chat(base_url, response_format={"type": "json_schema", "json_schema": good}).status_code == 200


def test_a_length_bounded_string_holds_no_raw_control_characters(client) -> None:
    """xgrammar lets a string with minLength / maxLength hold raw control characters, which JSON
    forbids: pushed towards a tab, the reply was `{"note": "()\\t\\t..."}` with a raw tab (finish
    reason stop, and json.loads failed), and a forced call's arguments so did not parse (its raw
    markup came back as content). Now the JSON parses and satisfies the schema."""
    reply = pushed_reply(client, NOTE, TAB, "note")
    assert reply.finish_reason == "stop"
    note = json.loads(reply.message.content)["note"]
    assert 2 <= len(note) <= 8 and all(ord(ch) >= 0x20 for ch in note)
    call = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Call it"}],
        max_tokens=60,
        temperature=0,
        logit_bias={str(TAB): 100},
        tools=[{"type": "function", "function": {"name": "remember", "parameters": NOTE}}],
        tool_choice={"type": "function", "function": {"name": "remember"}},
    ).choices[0]
    assert call.finish_reason == "stop" and call.message.tool_calls  # a named function's
    note = json.loads(call.message.tool_calls[0].function.arguments)["note"]
    assert 2 <= len(note) <= 8 and all(ord(ch) >= 0x20 for ch in note)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1]"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["yes", ""]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": ""}, "guided_grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ],
)
def test_a_bad_vllm_constraint_names_the_field_it_came_in(base_url, fields, param) -> None:
    """A guided_* value refused before compiling named `structured_outputs`, which the client did
    not send (one refused by the compiler already named its guided_* field)."""
    r = chat(base_url, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_bad_generate_constraint_names_sampling_params(server) -> None:
    """/generate's json_schema, regex and ebnf are 400s naming sampling_params, whichever check refuses them."""
    for sampling in (
        {"json_schema": "{not json"},
        {"json_schema": '{"type": "no-such-type"}'},
        {"regex": ""},
    ):
        r = httpx.post(f"{server.url}/generate", json={"text": "hi", "sampling_params": sampling}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "sampling_params", sampling


INT = {"type": "integer"}


@pytest.mark.parametrize(
    "schema, named",
    [
        ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems is not supported (at #)"),
        ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}, "at #/properties/n"),
        (
            {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}},
            "not is not supported (at #/properties/n)",
        ),
        ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "if"),
        ({"allOf": [INT, {"maximum": 3}]}, "allOf"),
        ({"type": "array", "items": INT, "contains": {"const": 5}}, "contains"),
        (
            {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
            "dependentRequired",
        ),
        ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "maxLength"),
        # xgrammar's regex automaton skips a lookahead (and matched "admin" here)
        ({"type": "string", "pattern": "^(?!admin$)[a-z]+$"}, "lookahead"),
        ({"type": "object", "patternProperties": {"^(?=x)": INT}}, "lookahead"),
        # xgrammar writes the format's regex, and the pattern went unread
        ({"type": "string", "format": "email", "pattern": "^a@b[.]cc$"}, "pattern beside format email"),
        ({"type": "object", "properties": {"a": INT}, "required": ["a", "b"]}, "'b'"),
        ({"$ref": "https://example.com/schema.json"}, "$ref"),
        # xgrammar reads a $ref, anyOf or oneOf alone, dropping what stands beside it
        ({"anyOf": [INT, {"type": "string", "maxLength": 2}], "type": "integer"}, "anyOf"),
        (
            {
                "type": "object",
                "properties": {"a": INT, "b": INT},
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
            },
            "anyOf",
        ),
        ({"$ref": "#/$defs/n", "$defs": {"n": INT}, "maximum": 3}, "$ref"),
    ],
)
def test_a_schema_the_grammar_cannot_hold_to_is_a_400(base_url, schema, named) -> None:
    """xgrammar reads some keywords without enforcing them: such a schema was served, and a reply
    that finished 'stop' could break it (duplicate items, a number that is no multiple, a missing
    required property, any value beside an anyOf). Now it is a 400 naming the keyword and where."""
    r = chat(
        base_url, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and named in err["message"], err["message"]
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}},
    }
    r = chat(base_url, tools=[tool], tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


@pytest.mark.slow
def test_schemas_as_pydantic_and_zod_write_them_are_served(base_url) -> None:
    """What the checks above leave alone: annotations beside a $ref or anyOf, a one-schema allOf,
    an enum with its type, multiples of an integer, a discriminated oneOf, a nullable type."""
    schema = {
        "$defs": {
            "Color": {"enum": ["red", "blue"], "title": "Color", "type": "string"},
            "Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
            "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]},
        },
        "type": "object",
        "properties": {
            "color": {"$ref": "#/$defs/Color", "description": "a color", "default": "red"},
            "old": {"allOf": [{"$ref": "#/$defs/Color"}], "title": "Old"},
            "maybe": {"anyOf": [{"type": "integer", "multipleOf": 5}, {"type": "null"}], "default": None},
            "pet": {
                "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                "discriminator": {"propertyName": "kind"},
            },
            "tag": {"type": ["string", "null"], "maxLength": 3},
        },
        "required": ["color", "old", "maybe", "pet", "tag"],
        "additionalProperties": False,
    }
    r = chat(
        base_url,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        value = json.loads(choice["message"]["content"])
        assert value["color"] in ("red", "blue") and value["pet"]["kind"] in ("cat", "dog")
        assert value["maybe"] is None or value["maybe"] % 5 == 0


def _schema(rng: random.Random, depth: int = 0, defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A random schema of the kinds clients send (pydantic's, zod's), with strings bounded so that
    the random model completes its JSON within a few dozen tokens."""
    if defs is None:  # the root: what its `$ref`s name goes in its `$defs`
        defs = {}
        root = _schema(rng, depth, defs)
        return {"$defs": defs, **root} if defs else root
    kinds = ["int", "num", "bool", "null", "str", "enum", "const", "pattern", "nullable"]
    kinds += ["object", "object", "array", "tuple", "anyOf", "ref"] if depth < 3 else []
    kind = rng.choice(kinds if depth else kinds[-6:])
    if kind == "int":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 99)}
    if kind == "num":
        return {"type": "number", "exclusiveMinimum": -2.5, "maximum": rng.choice([1, 7.25, 1000])}
    if kind in ("bool", "null"):
        return {"type": {"bool": "boolean", "null": "null"}[kind]}
    if kind == "str":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 5)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "a b", 'q"x', "tab\t", 3, None, [1], {"k": False}], 3)}
    if kind == "const":
        return {"const": rng.choice(["k", 2.5, {"z": [None]}])}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[0-9]{2}-[A-Z]$", "^(yes|no)$"])}
    if kind == "nullable":
        return {"type": [rng.choice(["integer", "boolean"]), "null"]}
    if kind == "object":
        names = rng.sample(["a", "b c", "ключ", 'q"', "n"], rng.randint(1, 3))
        props = {name: _schema(rng, depth + 1, defs) for name in names}
        out = {"type": "object", "properties": props, "required": [n for n in names if rng.random() < 0.6]}
        return {**out, "additionalProperties": False} if rng.random() < 0.6 else out
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _schema(rng, depth + 1, defs), "minItems": low, "maxItems": low + 2}
    if kind == "tuple":
        return {
            "type": "array",
            "prefixItems": [_schema(rng, depth + 1, defs) for _ in range(2)],
            "items": False,
        }
    if kind == "anyOf":
        return {"anyOf": [_schema(rng, depth + 1, defs), {"type": "null"}], "description": "optional"}
    name = f"d{len(defs)}"
    defs[name] = {}  # taken before its own schema is drawn, which may add more
    defs[name] = _schema(rng, depth + 1, defs)
    return {"$ref": f"#/$defs/{name}", "title": "Ref"}


RECURSIVE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["v", "next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}


def _conforms(value: Any, schema: Any, root: dict[str, Any]) -> bool:
    """Whether `value` satisfies `schema`, for the keywords `_schema` writes."""
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#").strip("/").split("/") if schema["$ref"] != "#" else []:
            target = target[part]
        return _conforms(value, target, root)
    if "anyOf" in schema:
        return any(_conforms(value, s, root) for s in schema["anyOf"])
    if "enum" in schema or "const" in schema:
        allowed = schema.get("enum", [schema.get("const")])
        return any(json.dumps(value, sort_keys=True) == json.dumps(a, sort_keys=True) for a in allowed)
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "string": lambda v: isinstance(v, str),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    if not any(checks[k](value) for k in kinds):
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        return low <= value <= high and value > schema.get("exclusiveMinimum", -math.inf)
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return False
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", math.inf)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if not set(schema.get("required", [])) <= set(value) or not set(value) <= set(props):
            return False  # xgrammar's strict mode: no property the schema does not name
        return all(_conforms(v, props[k], root) for k, v in value.items())
    if isinstance(value, list):
        if "prefixItems" in schema:
            prefix = schema["prefixItems"]
            return len(value) <= len(prefix) and all(_conforms(v, s, root) for v, s in zip(value, prefix))
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf):
            return False
        return all(_conforms(v, schema.get("items", {}), root) for v in value)
    return True


@pytest.mark.slow
def test_replies_that_finish_satisfy_their_schema(client) -> None:
    """A property over random schemas: greedy (pushed towards a raw tab, which JSON strings may not
    hold), sampled with n = 2, and streamed, a reply that finishes 'stop' is JSON that satisfies its
    schema, and one cut by max_tokens is a start the schema's grammar allows."""
    import xgrammar as xgr
    from xgrammar.testing import _get_matcher_from_grammar

    from deltaserve.engine.sampling.structured import json_grammar

    rng = random.Random(13)
    schemas = [_schema(rng) for _ in range(14)] + [RECURSIVE, NOTE]
    messages = [{"role": "user", "content": "JSON"}]
    for i, schema in enumerate(schemas):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        greedy = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=60,
            temperature=0,
            logit_bias={str(TAB): 100},
            response_format=fmt,
        )
        sampled = client.completions.create(
            model=MODEL_NAME,
            prompt="JSON:",
            max_tokens=60,
            n=2,
            temperature=1.0,
            seed=i,
            extra_body={"guided_json": schema},
        )
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=60,
            temperature=0,
            response_format=fmt,
            stream=True,
        )
        chunks = [c.choices[0] for c in stream if c.choices]
        replies = [(c.message.content, c.finish_reason) for c in greedy.choices]
        replies += [(c.text, c.finish_reason) for c in sampled.choices]
        replies.append(("".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason))
        for text, finish in replies:
            if finish == "stop":
                assert _conforms(json.loads(text), schema, schema), (schema, text)
            else:
                assert finish == "length"
                assert _get_matcher_from_grammar(json_grammar(xgr, json.dumps(schema))).accept_string(text)


SMALL = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
        "c": {"enum": ["x", "y"]},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


def _outside_strings(text: str) -> str:
    """`text` (JSON, or the start of it) without its strings' contents: the whitespace between
    tokens shows."""
    out, inside, escaped = [], False, False
    for ch in text:
        if inside:
            escaped, inside = (not escaped and ch == "\\"), (escaped or ch != '"')
        else:
            out.append(ch)
            inside = ch == '"'
    return "".join(out)


@pytest.mark.slow
def test_disable_any_whitespace_writes_json_without_whitespace(client) -> None:
    """vLLM's structured_outputs `disable_any_whitespace` was a 400 ('structured_outputs takes one
    of json, ...'). Now JSON is written with no whitespace between its tokens, for a schema, beside
    a response_format (as vLLM merges them) and for json_object; without it, `, ` and `: `."""
    compact = r'\{"a":\d,"b":\[(true|false),(true|false)\],"c":"[xy]"\}'
    spaced = r'\{"a": \d, "b": \[(true|false), (true|false)\], "c": "[xy]"\}'
    fmt = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL}}
    cases = [
        ({"extra_body": {"structured_outputs": {"json": SMALL, "disable_any_whitespace": True}}}, compact),
        (
            {"response_format": fmt, "extra_body": {"structured_outputs": {"disable_any_whitespace": True}}},
            compact,
        ),
        # every field written, as vLLM's StructuredOutputsParams serializes: the kinds null or false
        (
            {
                "response_format": fmt,
                "extra_body": {
                    "structured_outputs": {
                        **dict.fromkeys(("json", "regex", "choice", "grammar")),
                        "json_object": False,
                        "disable_any_whitespace": True,
                        "whitespace_pattern": None,
                    }
                },
            },
            compact,
        ),
        ({"extra_body": {"structured_outputs": {"json": SMALL, "disable_any_whitespace": False}}}, spaced),
        ({"response_format": fmt}, spaced),
    ]
    for fields, shape in cases:
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "JSON"}],
            max_tokens=40,
            temperature=0,
            **fields,
        )
        content = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and re.fullmatch(shape, content), (fields, content)
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="JSON:",
        max_tokens=40,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
    )
    for choice in r.choices:
        assert choice.text.startswith("{") and not re.search(r"\s", _outside_strings(choice.text)), (
            choice.text
        )


@pytest.mark.parametrize(
    "fields, param, named",
    [
        (
            {"guided_json": SMALL, "guided_whitespace_pattern": r"[ ]?"},
            "guided_whitespace_pattern",
            "separators",
        ),
        (
            {"structured_outputs": {"json": SMALL, "whitespace_pattern": r"[\n ]*"}},
            "structured_outputs",
            "whitespace_pattern is not supported",
        ),
        (
            {"guided_json": SMALL, "guided_decoding_backend": "outlines"},
            "guided_decoding_backend",
            "xgrammar",
        ),
        ({"structural_tag": '{"structures": []}'}, "structural_tag", "not supported"),
        (
            {"structured_outputs": {"json": SMALL, "no_such_option": 1}},
            "structured_outputs",
            "no_such_option",
        ),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "exactly one of"),
        (
            {"structured_outputs": {"json": SMALL, "structural_tag": '{"structures": []}'}},
            "structured_outputs",
            "structural_tag",
        ),
    ],
)
def test_a_structured_output_field_xgrammar_cannot_honour_is_a_400(base_url, fields, param, named) -> None:
    """vLLM's guided_whitespace_pattern, guided_decoding_backend and structural_tag were ignored
    (the reply was JSON with deltaserve's own whitespace, or free text for a structural tag): now
    a 400 naming the field, as structured_outputs' whitespace_pattern is."""
    r = chat(base_url, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"], err


def test_vllm_options_that_change_nothing_here_are_served(base_url) -> None:
    """disable_fallback (there is no other backend), an empty whitespace pattern (the default) and
    guided_decoding_backend xgrammar are what this server does anyway."""
    for fields in (
        {"structured_outputs": {"json": SMALL, "disable_fallback": True, "whitespace_pattern": None}},
        {"guided_json": SMALL, "guided_whitespace_pattern": "", "guided_decoding_backend": "xgrammar"},
    ):
        r = chat(base_url, max_tokens=40, temperature=0, **fields)
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["message"]["content"])["c"] in ("x", "y")


def test_a_pattern_beyond_ascii_holds_no_raw_control_characters(client) -> None:
    """xgrammar matched a pattern with a character beyond printable ASCII by raw characters, its
    `.` any at all: pushed towards a tab, the reply was `{"word": "é\\t\\t\\t"}` with raw tabs (finish
    'stop', and json.loads failed). Now the JSON parses and its string matches the pattern."""
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "pattern": "^é.{1,3}$"}},
        "required": ["word"],
        "additionalProperties": False,
    }
    reply = pushed_reply(client, schema, TAB, "word")
    assert reply.finish_reason == "stop"
    word = json.loads(reply.message.content)["word"]
    assert re.fullmatch("é.{1,3}", word) and all(ord(ch) >= 0x20 for ch in word), word


@pytest.mark.parametrize("pattern", ["^a\\nb$", "\\x01", 'say "hi"', "\u0001+"])
def test_a_pattern_only_raw_control_characters_or_quotes_match_is_a_400(base_url, pattern) -> None:
    """A pattern whose strings all hold a control character, '"' or '\\' was matched by the raw
    character: `{"x": "a<newline>b"}` finished 'stop' and did not parse. Now a 400 naming the
    pattern and where it is."""
    schema = {
        "type": "object",
        "properties": {"x": {"type": "string", "pattern": pattern}},
        "required": ["x"],
    }
    r = chat(
        base_url, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "(at #/properties/x/pattern)" in err["message"], err
    r = chat(base_url, guided_json=schema)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text


ZERO = 15  # the Qwen tokenizer's "0"


def test_an_ipv4_format_has_no_leading_zeros(client) -> None:
    """xgrammar's ipv4 allows leading zeros (`01.2.3.4`, `000.000.000.000`), which JSON Schema's
    ipv4 (a dotted quad) forbids: pushed towards "0", the reply finished 'stop' with an address
    no validator (nor Python's ipaddress) takes. Now each part is written without them."""
    import ipaddress

    schema = {
        "type": "object",
        "properties": {"ip": {"type": "string", "format": "ipv4"}},
        "required": ["ip"],
        "additionalProperties": False,
    }
    reply = pushed_reply(client, schema, ZERO, "host")
    assert reply.finish_reason == "stop"
    ip = json.loads(reply.message.content)["ip"]
    assert str(ipaddress.IPv4Address(ip)) == ip


def test_a_json_object_response_format_with_a_schema_holds_to_it(client) -> None:
    """response_format json_object with a `schema` beside it (Together's and Fireworks' JSON mode)
    was any JSON object, the schema ignored. Now the reply satisfies the schema."""
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object", "schema": SMALL},
    )
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", content
    assert re.fullmatch(r'\{"a": \d, "b": \[(true|false), (true|false)\], "c": "[xy]"\}', content), content


def test_disable_additional_properties_closes_objects_the_schema_leaves_open(client) -> None:
    """vLLM's structured_outputs `disable_additional_properties` was a 400 (an unknown field). Now an
    object whose schema says nothing of other properties takes none: `{"type": "object"}` is
    `{}`; structural_tag written null (as a client that sends every field does) is no 400."""
    schema = {"type": "object", "properties": {"o": {"type": "object"}}, "required": ["o"]}
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=20,
        temperature=0,
        extra_body={
            "structured_outputs": {
                "json": schema,
                "disable_additional_properties": True,
                "structural_tag": None,
            }
        },
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == '{"o": {}}'


def test_a_message_that_mentions_the_xml_form_leaves_a_forced_call_in_the_templates_form(base_url) -> None:
    """The form of a forced call was read off the whole prompt: a user message quoting
    `<function=...>` turned the built-in Qwen3 template's JSON calls into Qwen3.5's XML ones, which
    the model was not taught (and a tool with an email parameter, which the XML form cannot hold,
    was a 400). Now the form is read off the template's tool instructions alone."""
    tool = {
        "type": "function",
        "function": {
            "name": "mail",
            "parameters": {
                "type": "object",
                "properties": {"to": {"type": "string", "format": "email"}},
                "required": ["to"],
            },
        },
    }
    messages = [{"role": "user", "content": "What does <function=mail> mean in a prompt?"}]
    r = chat(base_url, messages=messages, tools=[tool], tool_choice="required", max_tokens=4)
    assert r.status_code == 200, r.text


def test_a_grammar_too_ambiguous_to_follow_is_a_400_that_stalls_no_one(
    base_url, builtin_path, until_idle
) -> None:
    """A grammar whose parse grows with every token (each run of a's splits many ways) ends its
    request with a 400 once one token's mask takes over a tenth of a second, while a stream beside
    it runs on. (Its masks, computed in the engine's step, took seconds a token and growing: no
    other request got a token for minutes.)"""
    import threading

    import openai

    eos = json.loads(open(f"{builtin_path}/generation_config.json").read())["eos_token_id"]
    grammar = 'root ::= s\ns ::= s s s | s s | "a" | "aa"'
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as api:
        beside: dict[str, Any] = {}

        def stream() -> None:
            chunks = api.completions.create(
                model=MODEL_NAME, prompt="hi", max_tokens=30, stream=True, extra_body={"ignore_eos": True}
            )
            beside["reasons"] = [c.choices[0].finish_reason for c in chunks if c.choices]

        streamer = threading.Thread(target=stream)
        streamer.start()
        with pytest.raises(openai.BadRequestError, match="too ambiguous to follow"):
            api.completions.create(
                model=MODEL_NAME,
                prompt="hi",
                max_tokens=400,
                logit_bias={str(t): -100 for t in eos},  # the grammar never lets it end
                extra_body={"structured_outputs": {"grammar": grammar}},
            )
        streamer.join(120)
        assert beside["reasons"][-1] == "length"
    until_idle(base_url.removesuffix("/v1"))
