"""Structured outputs through the HTTP server: what a schema, regex or grammar promises holds for
the built-in model's random weights (the grammar alone decides the text), and a request the
grammar machinery cannot serve is a 400 naming its field while the server goes on serving."""

from __future__ import annotations

import json

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


def test_a_length_bounded_string_holds_no_raw_control_characters(client) -> None:
    """xgrammar lets a string with minLength / maxLength hold raw control characters, which JSON
    forbids: pushed towards a tab, the reply was `{"note": "()\\t\\t..."}` with a raw tab (finish
    reason stop, and json.loads failed), and a forced call's arguments so did not parse (its raw
    markup came back as content). Now the JSON parses and satisfies the schema."""
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=30,
        temperature=0,
        logit_bias={str(TAB): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "note", "schema": NOTE}},
    )
    assert r.choices[0].finish_reason == "stop"
    note = json.loads(r.choices[0].message.content)["note"]
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
    assert call.finish_reason == "tool_calls" and call.message.tool_calls
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
