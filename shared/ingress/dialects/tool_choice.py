"""tool_choice and response_format as the `Constraint` a worker forces (shared/constrain/).

Both dialects map their own spelling onto `ToolChoice` (OpenAI "none" / "auto" /
"required" / a named function; Anthropic none / auto / any / tool). `none` and
`auto` force nothing: the model writes what it writes and the ingress parses
calls out of it. `required` forces one or more calls (one when parallel calls
are off) of the offered tools; `named` forces calls of that one tool. Every
constraint is compiled once here (`check`) before anything is queued, so a
schema the grammar compiler refuses is a 400 naming the request's field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from kvmesh.constrain.check import ConstraintError, validate
from kvmesh.ingress.core.errors import invalid
from kvmesh.protocol.serving import Constraint, ToolSchema
from kvmesh.toolcalls.formats import ToolFormat

Mode = Literal["none", "auto", "required", "named"]
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # what both APIs accept as a tool name


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Mode = "auto"
    name: str | None = None  # the tool, for "named"


def tool_schema(tool: dict[str, Any]) -> ToolSchema:
    """A tool in the function shape both dialects flatten to ({"type": "function", "function": {name,
    parameters}}), checked; ValueError says why."""
    if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ValueError('a tool must be {"type": "function", "function": {...}}')
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ValueError(f"function name {name!r} must be 1-64 letters, digits, '_' or '-'")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ValueError(f"function {name!r}: parameters must be a JSON schema of type object")
    return ToolSchema(name=name, parameters=params)


def tool_schemas(tools: list[dict[str, Any]] | None) -> list[ToolSchema]:
    """The offered tools (function-shaped dicts) as schemas; a 400 on param tools for a malformed one."""
    try:
        return [tool_schema(t) for t in tools or []]
    except ValueError as exc:
        raise invalid(f"tools: {exc}", param="tools") from None


def tool_constraint(tools: list[ToolSchema], choice: ToolChoice, fmt: ToolFormat,
                    parallel: bool) -> Constraint | None:
    """The constraint forcing `choice`'s calls, or None (none/auto); a 400 on param tool_choice when the
    choice needs tools the request does not offer."""
    if choice.mode in ("none", "auto"):
        return None
    if not tools:
        raise invalid(f"tool_choice {choice.mode!r} needs tools, and the request offers none", param="tool_choice")
    if choice.mode == "named":
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            offered = ", ".join(t.name for t in tools)
            raise invalid(f"tool_choice names the tool {choice.name!r}, which is not among the tools ({offered})",
                          param="tool_choice")
        tools = chosen[:1]
    return Constraint(kind="tool_calls", tools=tools, tool_format=fmt.name, parallel=parallel)


@dataclass(frozen=True, slots=True)
class ToolParsing:
    """Parse calls of `names` in this model's `fmt` out of the output."""

    fmt: ToolFormat
    names: tuple[str, ...]


def tool_parsing(tools: list[ToolSchema], choice: ToolChoice, fmt: ToolFormat) -> ToolParsing | None:
    """Calls are parsed from the output when tools are offered and tool_choice is not "none"."""
    if not tools or choice.mode == "none":
        return None
    return ToolParsing(fmt, tuple(t.name for t in tools))


def json_constraint(schema: dict[str, Any] | None) -> Constraint:
    """One JSON value matching `schema`; None: any JSON object."""
    return Constraint(kind="json", json_schema=schema)


def request_constraint(tools: list[ToolSchema], choice: ToolChoice, fmt: ToolFormat, parallel: bool,
                       answer: Constraint | None, answer_param: str) -> Constraint | None:
    """The one constraint a request decodes under, checked (a 400 before anything is queued).

    Forced calls (tool_choice required / named) win. Otherwise the answer's format (`answer`: OpenAI
    response_format, Responses text.format) is forced only when no tool may be called: one grammar
    cannot offer both a call and a schema-bound answer, and forcing JSON would make the tools uncallable.
    """
    calls = tool_constraint(tools, choice, fmt, parallel)
    if calls is not None:
        check(calls, "tools")
        return calls
    if answer is not None and (choice.mode == "none" or not tools):
        check(answer, answer_param)
        return answer
    return None


def check(c: Constraint | None, param: str) -> None:
    """A 400 naming `param` when the grammar cannot be built from `c` (nothing is queued yet)."""
    if c is None:
        return
    try:
        validate(c)
    except ConstraintError as exc:
        raise invalid(f"{param}: {exc}", param=param) from None
