"""Structured output at the edge: the request's constraint as one llguidance grammar.

Accepted forms, at most one per request:

* OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": true}}`` (``"text"``: none);
* vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": ...}``,
  ``{"choice": [...]}``, ``{"grammar": lark_or_gbnf}``, ``{"json_object": true}``;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

JSON is generated without free whitespace between tokens (``{"a": 1, "b": [2]}``): a
model at a high temperature could otherwise fill its budget with blank lines. A
constraint that does not compile is a 400 carrying llguidance's message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.grammar import GrammarCompiler, GrammarError
from frontend.errors import BadRequest
from frontend.grammar_limits import check_regex, check_schema

_JSON_OPTIONS: Any = {"whitespace_flexible": False}
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Constraint:
    kind: str  # json_schema, json_object, regex, choice, grammar
    value: Any
    param: str


def grammar_for(compiler: GrammarCompiler, constraint: Constraint | None) -> str | None:
    """The llguidance grammar for a request's constraint, validated; None without one."""
    if constraint is None:
        return None
    grammar = _grammar(constraint)
    try:
        compiler.validate(grammar)
    except GrammarError as e:
        raise BadRequest(
            f"{constraint.param}: the {constraint.kind.replace('_', ' ')} cannot be compiled: {e}",
            param=constraint.param,
            code="invalid_grammar",
        ) from None
    return grammar


def json_schema_grammar(schema: dict[str, Any] | str) -> str:
    import llguidance

    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))
    except ValueError as e:
        raise GrammarError(str(e)) from None


def _grammar(c: Constraint) -> str:
    import llguidance

    if c.kind == "regex":
        check_regex(c.value, c.param)
    if c.kind == "json_schema":
        check_schema(c.value, c.param)
    try:
        if c.kind == "json_schema":
            return json_schema_grammar(c.value)
        if c.kind == "json_object":
            return json_schema_grammar({"type": "object"})
        if c.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(c.value))
        if c.kind == "choice":
            return str(llguidance.grammar_from("choice", c.value))
        return str(llguidance.grammar_from("grammar", c.value))
    except (ValueError, GrammarError) as e:
        raise BadRequest(f"{c.param}: {e}", param=c.param, code="invalid_grammar") from None


# vLLM's guided_* request fields and the constraint kind each asks for
GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# every request field find_constraint reads: a body that sets none of them has none
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED})


def find_constraint(body: Any) -> Constraint | None:
    """The one constraint a request body asks for (a 400 for two, or a malformed one)."""
    found: list[Constraint] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        c = _response_format(fmt)
        if c is not None:
            found.append(c)
    so = getattr(body, "structured_outputs", None)
    if so:
        found.extend(_structured_outputs(so))
    for name, kind in GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append(_checked(Constraint(kind, value, name)))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise BadRequest(f"give at most one output constraint; got {names}", param=found[1].param)
    return found[0] if found else None


def _response_format(fmt: dict[str, Any]) -> Constraint | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json_object", None, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequest(
                "response_format.json_schema must be an object with a 'schema'",
                param="response_format.json_schema",
            )
        schema = spec.get("schema", {})  # OpenAI allows it missing: any JSON object
        return _checked(Constraint("json_schema", schema, "response_format.json_schema.schema"))
    raise BadRequest(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
        "'json_schema'",
        param="response_format.type",
    )


_SO_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def _structured_outputs(so: dict[str, Any]) -> list[Constraint]:
    out = []
    for key, value in so.items():
        if value is None or value is False:
            continue
        if key not in _SO_KINDS:
            if key in ("disable_fallback", "disable_any_whitespace", "whitespace_pattern"):
                continue  # options of vLLM's backends; ours needs none
            raise BadRequest(
                f"structured_outputs.{key} is not supported; use one of {', '.join(_SO_KINDS)}",
                param=f"structured_outputs.{key}",
            )
        out.append(_checked(Constraint(_SO_KINDS[key], value, f"structured_outputs.{key}")))
    return out


def _checked(c: Constraint) -> Constraint:
    v = c.value
    if c.kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise BadRequest(f"{c.param} is not valid JSON", param=c.param) from None
        if not isinstance(v, (dict, bool)):
            raise BadRequest(f"{c.param} must be a JSON schema object", param=c.param)
        return Constraint(c.kind, v, c.param)
    if c.kind in ("regex", "grammar") and (not isinstance(v, str) or not v):
        raise BadRequest(f"{c.param} must be a non-empty string", param=c.param)
    if c.kind == "choice" and (
        not isinstance(v, list)
        or not v
        or len(v) > MAX_CHOICES
        or not all(isinstance(x, str) and x for x in v)
    ):
        raise BadRequest(
            f"{c.param} must be a list of 1 to {MAX_CHOICES} non-empty strings", param=c.param
        )
    return c
