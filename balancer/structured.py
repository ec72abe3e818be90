"""Structured output on the HTTP API: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
fields, each turned into one fastgen.v1.Constraint (the replica compiles it into a grammar mask).

- response_format: {"type": "text"} (nothing), {"type": "json_object"}, or {"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": ...}} (the output is valid under the schema whether or not strict is set);
- structured_outputs: exactly one of {"json": schema, "regex": ..., "choice": [...], "grammar": ..., "json_object":
  true};
- guided_json, guided_regex, guided_choice, guided_grammar: vLLM's aliases of the same.
A request sets at most one of them. Pure: no I/O, no torch."""

from __future__ import annotations

import json
from typing import Any

from ..proto import fastgen_pb2
from .limits import RequestRefused, check_constraint

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredError(ValueError):
    """A bad structured-output field: a 400 naming it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_constraint(body: dict) -> fastgen_pb2.Constraint | None:
    """The body's one constraint, or None when it asks for none."""
    found: list[tuple[str, fastgen_pb2.Constraint]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        c = _response_format(response_format)
        if c is not None:
            found.append(("response_format", c))
    structured = body.get("structured_outputs")
    if structured is not None:
        found.append(("structured_outputs", _structured(structured)))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _of_kind(kind, body[name], name)))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise StructuredError(f"set one structured-output field, not several ({names})", found[1][0])
    if not found:
        return None
    name, constraint = found[0]
    try:
        check_constraint(constraint)
    except RequestRefused as e:
        raise StructuredError(str(e), name) from None
    return constraint


def _response_format(value: object) -> fastgen_pb2.Constraint | None:
    if not isinstance(value, dict):
        raise StructuredError(f"response_format must be an object, got {_short(value)}", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return fastgen_pb2.Constraint(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise StructuredError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}', "response_format"
            )
        schema = spec.get("schema", spec.get("json_schema"))
        return fastgen_pb2.Constraint(json_schema=_schema_text(schema, "response_format"))
    raise StructuredError(
        f'response_format type must be "text", "json_object" or "json_schema", got {_short(kind)}', "response_format"
    )


def _structured(value: object) -> fastgen_pb2.Constraint:
    if not isinstance(value, dict):
        raise StructuredError(f"structured_outputs must be an object, got {_short(value)}", "structured_outputs")
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise StructuredError(
            f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}, got {kinds or 'none'}",
            "structured_outputs",
        )
    return _of_kind(kinds[0], value[kinds[0]], "structured_outputs")


def _of_kind(kind: str, value: object, param: str) -> fastgen_pb2.Constraint:
    if kind == "json":
        return fastgen_pb2.Constraint(json_schema=_schema_text(value, param))
    if kind == "json_object":
        return fastgen_pb2.Constraint(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise StructuredError(f"{param}: choice must be a non-empty list of strings", param)
        return fastgen_pb2.Constraint(choice=fastgen_pb2.ChoiceList(choices=value))
    if not isinstance(value, str) or not value:
        raise StructuredError(f"{param}: {kind} must be a non-empty string", param)
    field: dict[str, Any] = {kind: value}  # regex or grammar: a string field of its name
    return fastgen_pb2.Constraint(**field)


def _schema_text(schema: object, param: str) -> str:
    """A JSON schema as JSON text: an object, or a string holding one (vLLM takes both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise StructuredError(f"{param}: the JSON schema is a string but not JSON", param) from None
    if not isinstance(schema, dict | bool):
        raise StructuredError(f"{param}: a JSON schema must be an object, got {_short(schema)}", param)
    return json.dumps(schema, separators=(",", ":"))


def _short(value: object) -> str:
    return repr(value)[:100]
