"""A request's structured-output spec to llguidance's grammar, and the checks that refuse bad ones.

llguidance takes every kind the OpenAI and vLLM APIs ask for: JSON schemas (its own compiler: fast
enough, ~1 ms for a dozen properties, to compile per request; docs/STRUCTURED.md), regular
expressions and Lark grammars. Choices become a Lark alternation of literal strings; GBNF grammars
(``root ::= ...``, what llama.cpp and xgrammar take, and what vLLM users send as ``guided_grammar``)
are translated to Lark by llguidance's converter; structural tags (free text with tagged JSON parts)
become a Lark grammar of lazy triggers (:func:`structural_tag_grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
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
_MISSING = object()


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


SpecialToken = Callable[[str], "int | None"]  # a text's id if it is one special token, else None


def structural_tag_grammar(
    tag: str, param: str = "structured_outputs.structural_tag", special: SpecialToken | None = None
) -> str:
    """llguidance's Lark grammar of vLLM's structural tag (the JSON text of ``{"structures":
    [{"begin", "schema", "end"}, ...], "triggers": [...]}``): free text, in which a trigger, once
    generated, must go on as one of the structures whose ``begin`` starts with it: the rest of
    ``begin``, JSON matching ``schema``, then ``end``; then free text again. A trigger is a lazy
    lexeme (the free text ends at its first occurrence); one that is a special token of the
    tokenizer (``special``: the engine knows, a check without the tokenizer does not) is referenced
    by its id, as text could never produce it. A bad form is a :class:`GrammarError` naming its field
    under ``param``."""
    try:
        value = json.loads(tag)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise GrammarError(f"{param} must be an object with 'structures' and 'triggers'", param)
    triggers, structures = value.get("triggers"), value.get("structures")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise GrammarError(
            f"{param}.triggers must be a non-empty array of non-empty strings", f"{param}.triggers"
        )
    if not isinstance(structures, list) or not structures:
        raise GrammarError(
            f"{param}.structures must be a non-empty array of objects", f"{param}.structures"
        )
    lines = ["%llguidance {}", "TAG_TEXT: /(.|\\n)*/"]
    for i, s in enumerate(structures):
        where = f"{param}.structures[{i}]"
        if not isinstance(s, dict):
            raise GrammarError(f"{where} must be an object with begin, schema and end", where)
        begin, end, schema = s.get("begin"), s.get("end", ""), s.get("schema", _MISSING)
        if not isinstance(begin, str) or not begin:
            raise GrammarError(f"{where}.begin must be a non-empty string", f"{where}.begin")
        if not isinstance(end, str):
            raise GrammarError(f"{where}.end must be a string", f"{where}.end")
        trigger = max((t for t in triggers if begin.startswith(t)), key=len, default=None)
        if trigger is None:
            raise GrammarError(
                f"{where}.begin {begin!r} starts with none of the triggers {triggers}",
                f"{where}.begin",
            )
        if schema is _MISSING or not isinstance(schema, dict):
            raise GrammarError(f"{where}.schema must be a JSON schema object", f"{where}.schema")
        try:
            error = llguidance.LLMatcher.validate_grammar(json_schema_grammar(schema))
        except GrammarError as e:
            error = str(e)
        if error:
            raise GrammarError(f"{where}.schema: {error.strip()}", f"{where}.schema")
        options = {**JSON_OPTIONS, "lenient": True}
        body = " ".join(
            part
            for part in (
                _lark_literal(begin[len(trigger) :]) if begin != trigger else "",
                "%json " + json.dumps({**schema, "x-guidance": options}),
                _lark_literal(end) if end else "",
            )
            if part
        )
        token = special(trigger) if special is not None else None
        if token is not None:  # a special token: the free text cannot contain it, nothing is lazy
            lines.append(f"tag_{i}: TAG_TEXT <[{token}]> {body}")
        else:
            lines.append(f"tag_{i}_trigger[lazy]: TAG_TEXT {_lark_literal(trigger)}")
            lines.append(f"tag_{i}: tag_{i}_trigger {body}")
    tags = " | ".join(f"tag_{i}" for i in range(len(structures)))
    lines.insert(1, f"start: ({tags})* TAG_TEXT")
    return "\n".join(lines) + "\n"


def grammar_of(
    spec: StructuredOutputs, param: str = "structured_outputs", special: SpecialToken | None = None
) -> str:
    """llguidance's grammar for ``spec`` (not yet checked: see :func:`check`); ``param`` and
    ``special``: see :func:`structural_tag_grammar`."""
    if spec.structural_tag is not None:
        return structural_tag_grammar(spec.structural_tag, param, special)
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


def check(
    spec: StructuredOutputs, param: str = "structured_outputs", special: SpecialToken | None = None
) -> str:
    """The checked grammar of ``spec``; :class:`GrammarError` naming ``param`` (the request's field;
    a structural tag's errors name the field inside it) with llguidance's message for one it cannot
    compile (a bad schema, regex or grammar)."""
    try:
        grammar = grammar_of(spec, param, special)
    except GrammarError as e:
        raise GrammarError(str(e), e.param if spec.structural_tag is not None else param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"cannot compile the {_kind(spec)}: {error.strip()}", param)
    return grammar


def _kind(spec: StructuredOutputs) -> str:
    if spec.structural_tag is not None:
        return "structural tag"
    if spec.json is not None:
        return "JSON schema"
    if spec.regex is not None:
        return "regex"
    if spec.choice is not None:
        return "choices"
    return "grammar"
