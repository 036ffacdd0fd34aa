"""Bound a JSON schema so that any walk through its grammar ends: the termination guarantee.

A grammar masks what a model may write, not how long it writes: from a
random model, `{"type": "string"}` is a random walk that rarely closes its
quote, a number can grow digits forever, a free-form object adds keys. So
where the schema says nothing, `bound_schema` adds a bound (the defaults are
`ConstraintSettings`, shared/config.py):

- strings without maxLength (and no enum/const/pattern/format): maxLength;
- arrays without maxItems: maxItems (never below minItems);
- integers/numbers without minimum/maximum: |n| < 10**max_integer_digits;
  numbers without multipleOf: multipleOf 10**-number_fraction_digits;
- objects with `properties` (or patternProperties): no extra keys (additionalProperties false);
  free-form objects (no listed keys): keys from `KEY_PATTERN`, maxProperties;
- `{}` / true (any value), also as an absent `items`: scalars, or arrays and
  objects of scalars (depth 2), all bounded as above.
Every bound only narrows: an output of the bounded schema validates against
the original. Not bounded: recursion through `$ref` and unbounded `pattern`s.
"""

from __future__ import annotations

import copy
from typing import Any

from kvmesh.config import ConstraintSettings

KEY_PATTERN = "^[A-Za-z_][A-Za-z0-9_]{0,15}$"  # the keys a free-form object may get
_SCALARS = ("string", "number", "integer", "boolean", "null")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items", "contains", "if", "then", "else", "additionalItems")
_STRING_FIXED = ("maxLength", "enum", "const", "pattern", "format")


def bound_schema(schema: dict[str, Any] | bool | None, bounds: ConstraintSettings) -> dict[str, Any]:
    """A bounded copy of `schema` (None: any JSON object). The input is not modified."""
    if schema is None:
        schema = {"type": "object"}
    return _bound(copy.deepcopy(schema), bounds)


def any_value(bounds: ConstraintSettings, depth: int = 2) -> dict[str, Any]:
    """Any JSON value, bounded: nested arrays/objects down to `depth` levels."""
    options: list[dict[str, Any]] = [_bound({"type": t}, bounds) for t in _SCALARS]
    if depth > 1:
        inner = any_value(bounds, depth - 1)
        options.append({"type": "array", "items": inner, "maxItems": bounds.max_array_items})
        options.append(_free_object(inner, bounds))
    return {"anyOf": options}


def _free_object(values: dict[str, Any], bounds: ConstraintSettings) -> dict[str, Any]:
    return {"type": "object", "patternProperties": {KEY_PATTERN: values}, "additionalProperties": False,
            "maxProperties": bounds.max_properties}


def _bound(schema: Any, bounds: ConstraintSettings) -> Any:
    if schema is True or schema == {}:
        return any_value(bounds)
    if not isinstance(schema, dict):
        return schema
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            schema[key] = {name: _bound(sub, bounds) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            schema[key] = [_bound(sub, bounds) for sub in schema[key]]
    for key in _SCHEMA_ONE:
        if key in schema and schema[key] is not False and not isinstance(schema[key], list):
            schema[key] = _bound(schema[key], bounds)
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else set()
    if "string" in types and not any(k in schema for k in _STRING_FIXED):
        schema["maxLength"] = max(bounds.max_string_length, _num(schema, "minLength", 0))
    if "array" in types:
        _bound_array(schema, bounds)
    if types & {"integer", "number"}:
        _bound_number(schema, bounds, integer=types == {"integer"})
    if "object" in types:
        _bound_object(schema, bounds)
    return schema


def _bound_array(schema: dict[str, Any], bounds: ConstraintSettings) -> None:
    if "maxItems" not in schema:
        schema["maxItems"] = max(bounds.max_array_items, _num(schema, "minItems", 0), _num(schema, "minContains", 0),
                                 len(schema.get("prefixItems", ())))
    if "items" not in schema:
        schema["items"] = any_value(bounds)


def _bound_number(schema: dict[str, Any], bounds: ConstraintSettings, integer: bool) -> None:
    limit = 10**bounds.max_integer_digits - 1
    low = _num(schema, "minimum", _num(schema, "exclusiveMinimum", None))
    high = _num(schema, "maximum", _num(schema, "exclusiveMaximum", None))
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = min(-limit, high) if high is not None else -limit
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = max(limit, low) if low is not None else limit
    if not integer and "multipleOf" not in schema:
        schema["multipleOf"] = 10.0**-bounds.number_fraction_digits


def _bound_object(schema: dict[str, Any], bounds: ConstraintSettings) -> None:
    extra = schema.get("additionalProperties", True)
    if extra is False:
        return
    if schema.get("properties") or schema.get("patternProperties"):
        # Extra keys would have to avoid the listed names (no lookahead in grammar regexes) and could not be
        # counted unless every listed key is required: the listed keys only.
        schema["additionalProperties"] = False
        return
    # A free-form object: name its keys (a random walk would never close an unbounded key) and count them.
    schema["patternProperties"] = {KEY_PATTERN: any_value(bounds) if extra is True else extra}
    schema["additionalProperties"] = False
    schema.setdefault("maxProperties", bounds.max_properties)


def _num(schema: dict[str, Any], key: str, default: Any) -> Any:
    """A numeric keyword's value, or `default` when absent or malformed (the compiler reports malformed ones)."""
    value = schema.get(key)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else default
