"""A request's structured-output spec to llguidance's grammar, and the checks that refuse bad ones.

llguidance takes every kind the OpenAI and vLLM APIs ask for: JSON schemas (its own compiler: fast
enough, ~1 ms for a dozen properties, to compile per request; docs/STRUCTURED.md), regular
expressions and Lark grammars. Choices become a Lark alternation of literal strings; GBNF grammars
(``root ::= ...``, what llama.cpp and xgrammar take, and what vLLM users send as ``guided_grammar``)
are translated to Lark by llguidance's converter.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from plaserve.request import StructuredOutputs

# Compact JSON with the separators json.dumps writes (", " and ": "), and no other whitespace: a model
# may not pad its answer with whitespace forever (random weights would), and the text parses as is.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """A structured-output spec the grammar engine cannot compile; ``param`` names the request field."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


def strict_schema(schema: Any) -> Any:
    """``schema`` as OpenAI's ``strict: true`` reads it: an object schema that does not say otherwise
    takes no properties beyond its declared ones (OpenAI requires ``additionalProperties: false``; here
    an object without the keyword gets it)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: Any, *, strict: bool = False) -> str:
    """llguidance's grammar for a JSON schema (a dict or its JSON text). ``strict``: as
    :func:`strict_schema`, and keywords llguidance cannot enforce are errors; otherwise they are
    ignored (``lenient``), as vLLM's llguidance backend does."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    if strict:
        schema = strict_schema(schema)
    options = {**JSON_OPTIONS, "lenient": not strict}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def _lark_literal(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal


def grammar_of(spec: StructuredOutputs) -> str:
    """llguidance's grammar for ``spec`` (not yet checked: see :func:`check`)."""
    if spec.json is not None:
        return json_schema_grammar(spec.json, strict=spec.strict)
    if spec.json_object:
        return json_schema_grammar(ANY_JSON_OBJECT)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(_lark_literal(c) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert spec.grammar is not None
    lark = spec.grammar
    if "::=" in lark:  # GBNF
        try:
            lark = gbnf_to_lark(lark)
        except Exception as e:  # noqa: BLE001 - the converter raises several kinds on bad input
            raise GrammarError(f"invalid GBNF grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check(spec: StructuredOutputs, param: str = "structured_outputs") -> str:
    """The checked grammar of ``spec``; :class:`GrammarError` naming ``param`` (the request's field)
    with llguidance's message for one it cannot compile (a bad schema, regex or grammar)."""
    try:
        grammar = grammar_of(spec)
    except GrammarError as e:
        raise GrammarError(str(e), param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"cannot compile the {_kind(spec)}: {error.strip()}", param)
    return grammar


def _kind(spec: StructuredOutputs) -> str:
    if spec.json is not None:
        return "JSON schema"
    if spec.regex is not None:
        return "regex"
    if spec.choice is not None:
        return "choices"
    return "grammar"
