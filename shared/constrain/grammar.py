"""A `Constraint` as an llguidance grammar: the one place that knows the grammar library's syntax.

JSON is written exactly as Python's `json.dumps` writes it (", " and ": ",
no other whitespace, properties in schema order), so a forced tool call is
byte for byte what the chat template renders for it on the next turn and
that turn's prefix hits the cache.

Tool calls (a Lark grammar with each tool's call as an embedded JSON schema):

    start: call (SEP call){0,max_parallel_calls-1}     # just `call` unless parallel
    call:  OPEN (tool_0 | tool_1 | ...) CLOSE
    tool_i: %json{"name": const, <args_key>: <parameters schema>}

The format's `prefix` (e.g. `<|python_tag|>`) is never forced: parsing skips it.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.config import ConstraintSettings
from kvmesh.constrain.bounds import bound_schema
from kvmesh.protocol.serving import Constraint
from kvmesh.toolcalls.formats import ToolFormat, UnknownToolFormat, get_format

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint no grammar can be built from; the message is one line, fit for a 400."""


def grammar_source(c: Constraint, bounds: ConstraintSettings) -> str:
    """The llguidance grammar (its serialized form) for `c`; ConstraintError for what cannot be compiled."""
    import llguidance

    if c.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(_schema(c.json_schema, bounds), overrides=JSON_OPTIONS)
    return llguidance.LLMatcher.grammar_from_lark(tool_call_lark(c, bounds))


def lark_source(c: Constraint, bounds: ConstraintSettings) -> str:
    """`c` as one Lark grammar (JSON as an embedded schema): the form an engine that runs llguidance itself takes
    (vLLM's `guidance` structured-output backend), with the same JSON options as `grammar_source`."""
    if c.kind == "json":
        return f"start: %json {json.dumps(_schema(c.json_schema, bounds))}\n"
    return tool_call_lark(c, bounds)


def tool_call_lark(c: Constraint, bounds: ConstraintSettings) -> str:
    """The Lark grammar of `c`'s tool calls (see the module docstring)."""
    if not c.tools:
        raise ConstraintError("tool_calls constraint with no tools")
    try:
        fmt: ToolFormat = get_format(c.tool_format)
    except UnknownToolFormat as exc:
        raise ConstraintError(str(exc)) from None
    names = [t.name for t in c.tools]
    if len(set(names)) != len(names):
        raise ConstraintError(f"duplicate tool names in {names}")
    rules = []
    for i, tool in enumerate(c.tools):
        call = {"type": "object", "properties": {"name": {"const": tool.name}, fmt.args_key: tool.parameters},
                "required": ["name", fmt.args_key], "additionalProperties": False}
        rules.append(f"tool_{i}: %json {json.dumps(_schema(call, bounds))}")
    alternatives = " | ".join(f"tool_{i}" for i in range(len(c.tools)))
    start = "call"
    if c.parallel and bounds.max_parallel_calls > 1:
        start = f"call ({_lit(fmt.separator)} call){{0,{bounds.max_parallel_calls - 1}}}"
    return "\n".join([
        f"start: {start}",
        f"call: {_lit(fmt.call_open)} ({alternatives}) {_lit(fmt.call_close)}",
        *rules,
    ]) + "\n"


def _lit(text: str) -> str:
    """A Lark string literal ('' for nothing: an empty literal is not allowed)."""
    return json.dumps(text) if text else ""


def _schema(schema: dict[str, Any] | None, bounds: ConstraintSettings) -> dict[str, Any]:
    if schema is not None and not isinstance(schema, dict):
        raise ConstraintError("a JSON schema must be an object")
    return {**bound_schema(schema, bounds), "x-guidance": JSON_OPTIONS}
