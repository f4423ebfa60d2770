"""Structured outputs: token masks from a grammar, so that the output is JSON (any object, or one
that satisfies a JSON schema).

xgrammar compiles the grammar against the tokenizer's vocabulary once (cached by schema) and
keeps one matcher per request, fed each token the request produces. Before sampling, each
constrained row gets the matcher's bitmask of allowed tokens (32 tokens a 32-bit word) and every
other logit is set to -inf; when the grammar is complete the matcher allows only the stop
tokens, and the request ends there. Requests that use it step synchronously (the mask needs the
previous token) and draft no speculative tokens.

A grammar can wait for a token (`StructuredOutputs.after_token`): a reasoning model whose prompt
opened `<think>` thinks freely, and its answer after `</think>` is held to the grammar (as vLLM
does with a reasoning parser). Until that token the request's rows get no mask.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from deltaserve.engine.requests.sampling_params import StructuredOutputs
from deltaserve.engine.sized_lru import SizedLRU

# compiled grammars kept for the requests that ask for them again, the least recently used dropped
# past this many bytes: each distinct schema has its own (about half a MB with a 150k vocabulary)
CACHE_BYTES = 256 * 2**20
# CPU time one request's next-token mask may take: masks are computed in the engine's step, so a
# grammar past it (an ambiguous one, whose parse grows with each token) would stall every stream
MAX_MASK_CPU_S = 0.1


def slow_mask_error(position: int) -> str:
    """The error of a request whose mask for output token `position` took over MAX_MASK_CPU_S."""
    return (
        f"the grammar took over {MAX_MASK_CPU_S:g} s to find the tokens it allows at output token "
        f"{position}: too ambiguous to follow without stalling every other request"
    )


class Grammars:
    """Grammars compiled for one tokenizer, and matchers for requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        try:
            import xgrammar
        except ImportError:
            raise ValueError(
                "structured outputs need xgrammar: pip install 'deltaserve[structured]'"
            ) from None
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # no cache of xgrammar's own: `compiled` is the one, and bounded
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.compiled: SizedLRU[str, Any] = SizedLRU(CACHE_BYTES)  # a running request's matcher keeps its own
        # grammars being compiled, by key: the engine compiles several at once (engine/core.py),
        # and the same one asked for again meanwhile waits for that compile instead of running another
        self.compiling: dict[str, Future[Any]] = {}
        self.lock = threading.Lock()

    def matcher(self, spec: StructuredOutputs) -> RequestGrammar:
        """A fresh matcher for `spec` (its grammar compiled on first use); ValueError for a
        schema xgrammar cannot compile."""
        return RequestGrammar(
            self.xgr.GrammarMatcher(self.compile(spec)), self.info.vocab_size, spec.after_token
        )

    def compile(self, spec: StructuredOutputs, wait: bool = True) -> Any:
        """`spec`'s compiled grammar, cached by its key (the server compiles a request's grammar
        in its worker thread before submitting it, so that the engine's thread finds it here).
        A grammar another thread is compiling is that compile's outcome; with `wait` False, its
        Future at once (its grammar, or its ValueError)."""
        key = spec.key()
        with self.lock:
            grammar = self.compiled.get(key)
            if grammar is not None:
                return grammar
            pending = self.compiling.get(key)
            ours = pending is None
            if pending is None:
                pending = self.compiling[key] = Future()
        if not ours:
            return pending.result() if wait else pending  # its grammar, or its ValueError
        try:
            grammar = self._compile(spec)
        except BaseException as exc:  # the ones waiting for it get the same
            with self.lock:
                del self.compiling[key]
            pending.set_exception(exc)
            raise
        with self.lock:
            self.compiled.put(key, grammar, grammar.memory_size_bytes)
            del self.compiling[key]
        pending.set_result(grammar)
        return grammar

    def _compile(self, spec: StructuredOutputs) -> Any:
        """`spec`'s grammar compiled now, or a ValueError saying why it cannot be."""
        schemas = [f.get("parameters") for f in spec.tool_calls or []] if spec.json is None else [spec.json]
        for schema in schemas:
            problem = unenforced(schema)
            if problem is not None:
                raise ValueError(
                    f"structured outputs: the JSON schema asks for what the grammar cannot enforce: {problem}"
                )
        try:
            if spec.tool_calls is not None:
                grammar = self.compiler.compile_grammar(
                    tool_call_grammar(
                        self.xgr,
                        spec.tool_calls,
                        spec.tool_call_form,
                        spec.max_tool_calls,
                        spec.optional_tool_calls,
                    )
                )
            elif spec.regex is not None:
                grammar = self.compiler.compile_regex(spec.regex)
            elif spec.choice is not None:
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
                grammar = self.compiler.compile_grammar(f"root ::= {alternatives}")
            elif spec.grammar is not None:
                grammar = self.compiler.compile_grammar(spec.grammar)
            else:
                # json_object is any JSON object (OpenAI's JSON mode: not an array or a scalar)
                schema = '{"type": "object"}' if spec.json_object else json.dumps(spec.json)
                if spec.disable_additional_properties:
                    schema = json.dumps(closed_objects(json.loads(schema)))
                grammar = self.compiler.compile_grammar(
                    json_grammar(self.xgr, schema, compact=spec.disable_any_whitespace)
                )
        except Exception as e:  # xgrammar's own message: an unsupported or broken schema
            # (without its "[time] /path/file.cc:line: " prefix)
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip())
            free_form = spec.regex is not None or spec.choice is not None or spec.grammar is not None
            what = "grammar" if free_form else "JSON schema"
            raise ValueError(f"structured outputs: the {what} cannot be compiled ({reason})") from None
        return grammar


# what may stand beside a $ref, anyOf, oneOf or allOf: xgrammar reads the combinator alone, so only
# annotations (and what its strict mode implies anyway) keep their meaning there
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
    | {"$defs", "definitions", "$schema", "$id", "$anchor", "discriminator", "nullable"}
)
_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
# keywords xgrammar 0.2 accepts without enforcing them
_IGNORED = (
    "not dependentRequired dependentSchemas dependencies contains minContains maxContains $dynamicRef $recursiveRef"
).split()


def unenforced(schema: Any) -> str | None:
    """What in the JSON schema `schema` xgrammar would read without enforcing it, and where (a JSON
    pointer), or None: a reply that finished could then break the schema."""
    for node, at in _subschemas(schema):
        problem = _unenforced_here(node)
        if problem is not None:
            return f"{problem} (at {at})"
    return None


def _subschemas(schema: Any) -> Iterator[tuple[dict[str, Any], str]]:
    """`schema` and the schemas in it (not the values of const, enum or default), each with its
    JSON pointer."""
    stack = [(schema, "#")]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, at
        for key, value in node.items():
            if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
                stack += [(v, f"{at}/{key}/{_pointer(k)}") for k, v in value.items()]
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems", "items") and isinstance(value, list):
                stack += [(v, f"{at}/{key}/{i}") for i, v in enumerate(value)]
            elif key in ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems"):
                stack.append((value, f"{at}/{key}"))
            elif key in ("propertyNames", "additionalItems", "then", "else"):
                stack.append((value, f"{at}/{key}"))


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that does not set it
    (changed in place)."""
    for node, _ in list(_subschemas(schema)):
        kind = node.get("type")
        kinds: list[Any] = kind if isinstance(kind, list) else [kind]
        if ("object" in kinds or "properties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return schema


def _pointer(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


# Python's regex parser (sre_parse before 3.11): a pattern's fewest and most characters
_RE_PARSER = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")
# formats whose every value xgrammar writes has a character or more (pydantic's AnyUrl sets minLength 1)
_NONEMPTY_FORMATS = frozenset("date time date-time duration email uuid ipv4 ipv6 hostname uri".split())


def _lengths_implied(node: dict[str, Any]) -> bool:
    """Whether every string the node's pattern (or format) admits already meets its minLength and
    maxLength, which xgrammar reads beside them without enforcing: `^[A-Z]{3}$` with maxLength 3."""
    low, high = node.get("minLength", 0), node.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        return False
    if "pattern" not in node:
        return high is None and low <= 1 and node.get("format") in _NONEMPTY_FORMATS
    width = _pattern_width(node["pattern"])
    return width is not None and width[0] >= low and (high is None or width[1] <= high)


def _pattern_width(pattern: Any) -> tuple[int, int] | None:
    """The fewest and most characters a string matching `pattern` whole has; None when unbounded
    or unreadable. (xgrammar holds a JSON string to its pattern whole, anchors or not.)"""
    if not isinstance(pattern, str):
        return None
    body = pattern.removeprefix("^")
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    try:
        low, high = _RE_PARSER.parse(body).getwidth()
    except (re.error, RecursionError, OverflowError):
        return None
    return None if high >= _RE_PARSER.MAXREPEAT else (int(low), int(high))


def _unenforced_here(node: dict[str, Any]) -> str | None:
    """The first thing in this one schema object (not its subschemas) that xgrammar ignores."""
    for key in _IGNORED:
        if key in node:
            return f"{key} is not supported"
    if "if" in node and ("then" in node or "else" in node):
        return "if / then / else is not supported"
    if node.get("uniqueItems") is True:
        return "uniqueItems is not supported"
    if "multipleOf" in node:
        kind = node.get("type")
        types: list[Any] = kind if isinstance(kind, list) else [kind]
        step = node["multipleOf"]
        whole = isinstance(step, (int, float)) and not isinstance(step, bool) and float(step).is_integer()
        if "integer" not in types or "number" in types or not whole:
            return "multipleOf is supported only as a whole number, on an integer type"
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"$ref {ref!r} is not supported, only references within the schema (#/...)"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "allOf of more than one schema is not supported"
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        if not _lengths_implied(node) and _bounded_uri(node) is None:
            return "minLength / maxLength beside pattern or format are not supported"
    patterns = [node.get("pattern")] + list(node.get("patternProperties") or {})
    if any(isinstance(p, str) and _lookahead(p) for p in patterns):
        return "a lookahead ((?= or (?!) in a pattern is not supported (the grammar would ignore it)"
    if "pattern" in node and node.get("format") in _FORMATS:
        return f"pattern beside format {node['format']} is not supported (the grammar would read the format alone)"
    if isinstance(node.get("required"), list):
        declared = node.get("properties")
        properties: dict[str, Any] = declared if isinstance(declared, dict) else {}
        missing = [name for name in node["required"] if name not in properties]
        if missing:
            return f"required names {missing[0]!r}, which properties does not define"
    combinators = [k for k in _COMBINATORS if k in node]
    beside = [
        k
        for k, v in node.items()
        if k not in _ANNOTATIONS
        and k not in combinators
        and not k.startswith("x-")
        and not (k in ("additionalProperties", "unevaluatedProperties") and v is False)
    ]
    if combinators and (len(combinators) > 1 or beside):
        other = (combinators[1:] + beside)[0]
        return f"{combinators[0]} beside {other} is not supported (the grammar would read the {combinators[0]} alone)"
    return None


def _lookahead(pattern: str) -> bool:
    """Whether the regex `pattern` has a lookahead, `(?=` or `(?!`, outside a character class."""
    escaped = in_class = False
    for i, ch in enumerate(pattern):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(" and pattern[i + 1 : i + 3] in ("?=", "?!"):
            return True
    return False


# the formats xgrammar 0.2 writes a regex of (it reads any other as a free string, and a pattern beside
# it then holds), and ipv4's without the leading zeros its own allows ("01.2.3.4"), which JSON
# Schema's ipv4 (RFC 2673's dotted quad) forbids
_FORMATS = frozenset(
    "email date time date-time duration ipv4 ipv6 hostname uuid uri uri-reference uri-template".split()
    + ["json-pointer", "relative-json-pointer"]
)
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = f"^{_OCTET}(\\.{_OCTET}){{3}}$"
# xgrammar's date takes any day 01-31 of any month (2024-02-31, 2023-02-29): a date is written only
# as a real one of the Gregorian calendar, its 29 February only in a leap year (a year divisible by
# 4 and not by 100, or by 400), and date-time's date likewise (its time as xgrammar writes it)
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)"
_DAY = (
    "[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29"
)
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_DATE = f"^({_DAY})$"
_DATE_TIME = f"^({_DAY})T{_TIME}$"
# formats xgrammar writes too loosely, written as the patterns above instead
_FORMAT_PATTERNS = {"ipv4": _IPV4, "date": _DATE, "date-time": _DATE_TIME}
# a bounded URI: scheme (16 at most), "://", host (253), port (":" and 5), and the first character
# of each of path, query and fragment; each of those three then holds 129 or more, as xgrammar
# compiles a bounded repetition of up to 128 characters there in seconds
_URI_FIXED = 16 + 3 + 253 + 6 + 3
_URI_PART_MIN = 129
_PCHAR = r"A-Za-z0-9._~!$&'()*+,;=:@\-"


def _bounded_uri(node: dict[str, Any]) -> str | None:
    """For format uri with a maxLength (pydantic's HttpUrl: 2083), which xgrammar's uri leaves
    unbounded: a pattern of URIs of minLength to maxLength characters,
    `scheme://host[:port][/path][?query][#fragment]` in RFC 3986's characters without percent
    escapes; None for any other node, or bounds too narrow for one."""
    low, high = node.get("minLength", 0), node.get("maxLength")
    if node.get("format") != "uri" or "pattern" in node or type(high) is not int or type(low) is not int:
        return None
    rest = high - _URI_FIXED
    host = max(1, low - 4)
    if rest < 3 * _URI_PART_MIN or host > 253:
        return None
    fragment, query = max(_URI_PART_MIN, rest // 8), max(_URI_PART_MIN, rest // 4)
    return (
        f"^[a-zA-Z][a-zA-Z0-9+.\\-]{{0,15}}://[A-Za-z0-9.\\-]{{{host},253}}(:[0-9]{{1,5}})?"
        f"(/[{_PCHAR}/]{{0,{rest - query - fragment}}})?(\\?[{_PCHAR}/?]{{0,{query}}})?"
        f"(#[{_PCHAR}/?]{{0,{fragment}}})?$"
    )


# the characters xgrammar 0.2 lets a string with minLength / maxLength (or a key bounded by
# propertyNames) hold, raw control characters among them, which JSON forbids (a tab must be "\t")
_LOOSE_CHARS = r"[^\"\\\r\n]"
_JSON_CHARS = r"[^\0-\x1f\"\\]"


def json_grammar(xgr: Any, schema: str, compact: bool = False) -> Any:
    """xgrammar's grammar of the JSON schema `schema` (its text), with json.dumps' separators (`, `
    and `: `; with `compact`, `,` and `:`) and no other whitespace; its bounded strings hold no raw
    control characters."""
    separators = (",", ":") if compact else (", ", ": ")
    value = json.loads(schema)
    if _json_string_patterns(xgr, value):
        schema = json.dumps(value)
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=separators)
    text = str(grammar)
    fixed = text.replace(_LOOSE_CHARS, _JSON_CHARS)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def _json_string_patterns(xgr: Any, schema: Any) -> bool:
    """Rewrite, in place, the patterns of `schema`'s strings and property names so that xgrammar
    holds them to JSON's escapes, and its ipv4, date and date-time formats as patterns
    (_FORMAT_PATTERNS); whether any changed. xgrammar matches a pattern that only
    printable ASCII spells with the characters a JSON string may hold raw (none of '"', '\\' or
    control characters), but matches any other by raw characters: `é.*` let a '"' end the string
    early, `a\\nb` wrote a raw newline (invalid JSON, finish 'stop'). Other characters are spelled
    as \\u escapes; a pattern that still needs raw ones is a ValueError."""
    changed = False
    for node, at in list(_subschemas(schema)):
        written = _FORMAT_PATTERNS.get(str(node.get("format")))
        if written is not None:  # as the pattern it is: no leading zeros, no 31 February
            del node["format"]
            node["pattern"], changed = written, True
        bounded = _bounded_uri(node)
        if (
            bounded is not None
        ):  # its lengths in the pattern, which xgrammar holds (it reads them beside one only)
            for key in ("format", "minLength", "maxLength"):
                node.pop(key, None)
            node["pattern"], changed = bounded, True
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            node["pattern"] = _held_pattern(xgr, pattern, f"{at}/pattern")
            changed |= node["pattern"] != pattern
        named = node.get("patternProperties")
        if isinstance(named, dict):
            node["patternProperties"] = {
                _held_pattern(xgr, k, f"{at}/patternProperties/{_pointer(k)}"): v for k, v in named.items()
            }
            changed |= list(node["patternProperties"]) != list(named)
    return changed


def _held_pattern(xgr: Any, pattern: str, at: str) -> str:
    """`pattern` spelled in printable ASCII (its other characters as \\u escapes), or a ValueError
    where xgrammar would still match it by raw characters."""
    out: list[str] = []
    escaped = False  # the last character was an escaping backslash
    for ch in pattern:
        if " " <= ch <= "~":
            out.append(ch)
            escaped = not escaped and ch == "\\"
            continue
        if escaped:  # a backslash before é means é itself
            out.pop()
        out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\u{{{ord(ch):x}}}")
        escaped = False
    spelled = "".join(out)
    try:
        probe = str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": spelled})))
    except Exception:  # not a regex xgrammar reads: the schema's own compile says why
        return spelled
    if "json_string=true" not in probe:
        raise ValueError(
            f"the pattern {pattern!r} (at {at}) is not supported: it needs a control character, '\"' or "
            "'\\\\' in the string, or uses what xgrammar's regex automaton does not read, and the grammar "
            "would write such characters raw, which JSON forbids"
        )
    return spelled


def tool_call_grammar(
    xgr: Any, functions: list[dict[str, Any]], form: str = "json", most: int = 1, optional: bool = False
) -> Any:
    """One call, or up to `most` calls back to back, of `functions` in the model's tool-call form.
    "json" (Qwen3): `<tool_call>`, a JSON object with the function's name and arguments that
    satisfy its parameters' schema, `</tool_call>`. "xml" (Qwen3.5): `<tool_call>`,
    `<function=NAME>`, one `<parameter=P>` block per parameter in the schema's order (the required
    ones always), `</function>`, `</tool_call>`; a string's value is its text, held to its const,
    enum, format, pattern or lengths (without `<`), else free text (with no `</` or `<parameter=`
    in it), any other (or untyped) value its JSON, held to the schema, and a parameter with only
    annotations free text. Qwen's calls are separated by a newline. "kimi" (Kimi-Linear): one
    section, and in it per call `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>`, the
    arguments' JSON, `<|tool_call_end|>`.
    `optional` (tool_choice auto): free text, in which each `<tool_call>` the model opens (Kimi: its
    section) holds calls as above; one call with `most` 1, else any number (Kimi: up to `most`)."""

    def one(index: int) -> Any:  # a call of any of the functions, the index-th of the turn
        calls = []
        for f in functions:
            params = f.get("parameters") or {"type": "object"}
            if form == "xml":
                calls.append(_xml_call(xgr, f["name"], params))
            elif form == "kimi":  # the arguments are the JSON object itself
                calls.append(
                    xgr.Grammar.concat(
                        _literal(
                            xgr,
                            f"<|tool_call_begin|>functions.{f['name']}:{index}<|tool_call_argument_begin|>",
                        ),
                        json_grammar(xgr, json.dumps(params)),
                        _literal(xgr, "<|tool_call_end|>"),
                    )
                )
            else:  # the arguments compiled as a schema of their own: their refs to `#...` land in them
                name = json.dumps(f["name"], ensure_ascii=False)
                calls.append(
                    xgr.Grammar.concat(
                        _literal(xgr, f'\n{{"name": {name}, "arguments": '),
                        json_grammar(xgr, json.dumps(params)),
                        _literal(xgr, "}\n"),
                    )
                )
        return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)

    opener, closer = _CALL_MARKERS[form]
    if optional:
        from xgrammar import structural_tag as st

        # what a call holds between the markers; the model's text around the calls is free
        inside = one(0) if form != "kimi" else _calls(xgr, one, "", most)
        tag = st.TagFormat(begin=opener, content=st.GrammarFormat(grammar=str(inside)), end=closer)
        calls = st.TriggeredTagsFormat(
            triggers=[opener], tags=[tag], stop_after_first=form == "kimi" or most == 1
        )
        return xgr.Grammar.from_structural_tag(st.StructuralTag(format=calls))
    if form == "kimi":
        return xgr.Grammar.concat(_literal(xgr, opener), _calls(xgr, one, "", most), _literal(xgr, closer))
    return _calls(
        xgr,
        lambda index: xgr.Grammar.concat(_literal(xgr, opener), one(index), _literal(xgr, closer)),
        "\n",
        most,
    )


# each form's markers around one call (Qwen's) or around the turn's calls (Kimi's section)
_CALL_MARKERS = {
    "json": ("<tool_call>", "</tool_call>"),
    "xml": ("<tool_call>", "</tool_call>"),
    "kimi": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
}


def _calls(xgr: Any, one: Callable[[int], Any], sep: str, most: int) -> Any:
    """Call 0, then optionally (`sep`, call 1, then optionally (...)), up to `most` calls."""
    turn = one(most - 1)
    for index in reversed(range(most - 1)):
        more = xgr.Grammar.concat(_literal(xgr, sep), turn) if sep else turn
        turn = xgr.Grammar.concat(one(index), xgr.Grammar.union(_literal(xgr, ""), more))
    return turn


def _literal(xgr: Any, text: str) -> Any:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _free_text() -> str:
    """The grammar of a parameter's free text: anything with neither a closing tag (`</`) nor
    `<parameter=`, where the tool-call parser would end the value (and start another parameter).
    State `tN` has read `<` and the first N characters of `parameter=`."""
    word = "parameter="
    rules = ['root ::= "" | [^<] root | "<" t0', 't0 ::= "" | [^/p<] root | "<" t0 | "p" t1']
    for i in range(1, len(word)):
        ahead = f' | "{word[i]}" t{i + 1}' if i + 1 < len(word) else ""  # `<parameter=` has no way on
        rules.append(f't{i} ::= "" | [^{word[i]}<] root | "<" t0{ahead}')
    return "\n".join(rules)


_FREE_TEXT = _free_text()


def _definitions(params: dict[str, Any]) -> dict[str, Any]:
    """A parameters schema's `$defs` / `definitions` (pydantic's, for enums and nested models)."""
    return {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}


def resolved_ref(schema: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema with a `$ref` into the parameters' definitions replaced by what it
    names (its sibling keywords kept), so that its type shows."""
    for _ in range(8):  # a ref to a ref, not forever
        ref = schema.get("$ref")
        if not isinstance(ref, str):
            break
        section, _, name = ref.removeprefix("#/").partition("/")
        target = _definitions(params).get(section, {}).get(name)
        if not isinstance(target, dict):
            break
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


# formats whose every string is the same text raw as inside JSON (no '"', '\\', control character or '<'):
# an XML value is held to xgrammar's (or _FORMAT_PATTERNS') grammar of them; email and the JSON
# pointers may need escapes there, so an XML value cannot hold to them
_RAW_FORMATS = frozenset(
    "date time date-time duration ipv4 ipv6 hostname uuid uri uri-reference uri-template".split()
)
_QUOTED_ROOT = re.compile(r'^root ::= \(\("\\"" (\w+) "\\""\)\)$', re.MULTILINE)


def _xml_value(xgr: Any, schema: dict[str, Any]) -> Any:
    """The grammar of a parameter's value as server/text/tool_calls.py reads it back: a string's
    text raw, any other value (or one the schema does not type) as its JSON."""
    kind = schema.get("type")
    if kind == "string":
        return _xml_string(xgr, schema)
    if kind is None and any(k in schema for k in ("enum", "const")):  # values the parser reads back as such
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return _alternatives(
            xgr, [v if isinstance(v, str) and not _reads_as_json(v) else json.dumps(v) for v in values]
        )
    if kind is None and all(k in _ANNOTATIONS or k.startswith("x-") for k in schema):
        # any value: the parser reads text that is not JSON as a string
        return xgr.Grammar.from_ebnf(_FREE_TEXT)
    # a number's, boolean's, object's or array's JSON, its bounds held; an untyped schema's or a
    # list of types' (anyOf, "string" or "null", ...) JSON too, which the parser reads as JSON
    return json_grammar(xgr, json.dumps(schema))


def _xml_string(xgr: Any, schema: dict[str, Any]) -> Any:
    """A string parameter's text (raw): its const, enum, format, pattern or lengths held."""
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return _alternatives(xgr, [v for v in values if isinstance(v, str)])
    fmt = schema.get("format")
    if fmt in _FORMATS:
        if fmt not in _RAW_FORMATS:
            raise ValueError(
                f"format {fmt} is not supported in the XML tool-call form (its strings may need JSON escapes)"
            )
        # xgrammar's grammar of the JSON string (a bounded uri's lengths held), less its quotes
        lengths = {k: schema[k] for k in ("minLength", "maxLength") if k in schema}
        text = str(json_grammar(xgr, json.dumps({"type": "string", "format": fmt, **lengths})))
        inner = _QUOTED_ROOT.search(text)
        if inner is None:
            raise ValueError(f"format {fmt} is not supported in the XML tool-call form")
        return xgr.Grammar.from_ebnf(_QUOTED_ROOT.sub(f"root ::= (({inner.group(1)}))", text))
    if isinstance(schema.get("pattern"), str):
        return xgr.Grammar.from_regex(schema["pattern"])
    if "minLength" in schema or "maxLength" in schema:
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        return xgr.Grammar.from_ebnf(f"root ::= [^<]{{{low},{'' if high is None else int(high)}}}")
    return xgr.Grammar.from_ebnf(_FREE_TEXT)


def _alternatives(xgr: Any, texts: list[str]) -> Any:
    if not texts:
        raise ValueError("an enum or const with no value the parameter's type allows")
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(t, ensure_ascii=False) for t in texts))


def _reads_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


_PARAMETERS = "deltaserve_parameters"  # where a value compiled alone finds the parameters schema
_VALUES = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are no schemas


def _rebased(node: Any) -> Any:
    """A copy of `node` whose refs into the parameters (`#`, `#/$defs/...`) point at their copy
    under `$defs/deltaserve_parameters`: a parameter's value is compiled as a schema of its own,
    where `#` would be the value itself (a tree's `child: {"$ref": "#"}`)."""
    if isinstance(node, list):
        return [_rebased(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = f"#/$defs/{_PARAMETERS}{v[1:]}"
        else:
            out[k] = v if k in _VALUES else _rebased(v)
    return out


def _xml_call(xgr: Any, name: str, params: dict[str, Any]) -> Any:
    parts = [_literal(xgr, f"\n<function={name}>\n")]
    root = resolved_ref(params, params)  # pydantic's root model: a $ref into its own $defs
    for key in ("anyOf", "oneOf", "allOf"):  # one list of parameter blocks cannot spell alternatives
        if key in root:
            raise ValueError(f"{key} at the parameters' root is not supported in the XML tool-call form")
    required = set(root.get("required") or [])
    for key, schema in (root.get("properties") or {}).items():
        schema = resolved_ref(schema, params)
        if schema.get("type") != "string":  # compiled alone as JSON: its refs must land in the parameters
            schema = _rebased(schema)
            schema["$defs"] = {**(schema.get("$defs") or {}), _PARAMETERS: _rebased(params)}
        block = xgr.Grammar.concat(
            _literal(xgr, f"<parameter={key}>\n"), _xml_value(xgr, schema), _literal(xgr, "\n</parameter>\n")
        )
        # an optional parameter: the block or nothing
        parts.append(block if key in required else xgr.Grammar.union(block, _literal(xgr, "")))
    parts.append(_literal(xgr, "</function>\n"))
    return xgr.Grammar.concat(*parts)


class RequestGrammar:
    """One request's place in its grammar; with `after`, the grammar starts once that token has
    been produced (the tokens up to it are free, and not fed to the matcher)."""

    def __init__(self, matcher: Any, vocab_size: int, after: int | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # tokens the grammar knows; later ids are never allowed
        self.waiting_for = after

    @property
    def active(self) -> bool:
        """Whether the next token is under the grammar (its mask applies)."""
        return self.waiting_for is None

    def accept(self, token: int) -> bool:
        if self.waiting_for is not None:
            if token == self.waiting_for:
                self.waiting_for = None
            return True
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return self.active and bool(self.matcher.is_terminated())


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], grammars: list[RequestGrammar]) -> list[int]:
    """Set to -inf, in place, the logits of tokens that `grammars[j]` does not allow next, in row
    `rows[j]` of `logits` `[n, vocab]`. Returns the j whose mask took over MAX_MASK_CPU_S."""
    import xgrammar

    k, vocab = len(rows), logits.shape[-1]
    known = min(vocab, grammars[0].vocab_size)
    bitmask = xgrammar.allocate_token_bitmask(k, grammars[0].vocab_size)  # [k, words] int32
    slow = []
    for j, g in enumerate(grammars):
        started = time.thread_time()  # CPU time: a busy host does not make a grammar slow
        g.matcher.fill_next_token_bitmask(bitmask, j)
        if time.thread_time() - started > MAX_MASK_CPU_S:
            slow.append(j)
    dev = logits.device
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    # token t is bit t % 32 of word t // 32 (expanded on the logits' device: 32x fewer bytes sent)
    bits = ((bitmask.to(dev).unsqueeze(-1) >> shifts) & 1).bool().view(k, -1)
    allowed = torch.zeros(k, vocab, dtype=torch.bool, device=dev)
    allowed[:, :known] = bits[:, :known]
    index = torch.tensor(rows, dtype=torch.long, device=dev)
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)
    return slow
