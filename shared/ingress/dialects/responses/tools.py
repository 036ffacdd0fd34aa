"""What a Responses request's tools, `tool_choice` and `text.format` mean for its prompt, decoding and output.

`plan_tools` validates them (a bad one is a 400 naming it, before anything
is published) and returns a `ToolPlan`: the tools in the shape chat
templates render, the tools as the response echoes them, the decoding
`Constraint` (shared/ingress/dialects/tool_choice.py), and `splitter(stream)`, which
separates the model's tool-call syntax from its text:
- "required" or a named function force calls (a grammar on the worker);
- "auto" forces nothing and calls are parsed out of what the model wrote;
- "none" (or no tools): everything is text;
- `text.format` json_object / json_schema forces JSON only when no tool may
  be called: one grammar cannot offer both a call and a schema-bound answer
  yet, and forcing JSON would make an agent's tools uncallable.
A stream splits calls as they form (`ToolCallStream`: a committed call stays
a call); a whole response is split once at the end (`parse_output`: a call
cut short or malformed stays text), as /v1/chat/completions does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.ingress.core.state import IngressState
from kvmesh.ingress.dialects.responses.models import (
    FormatJsonObject,
    FormatJsonSchema,
    FunctionTool,
    ResponsesRequest,
    ToolChoiceFunction,
)
from kvmesh.ingress.dialects.responses.stream import OutputBuilder
from kvmesh.ingress.dialects.tool_choice import (
    ToolChoice,
    json_constraint,
    request_constraint,
)
from kvmesh.protocol.serving import Constraint, ToolSchema
from kvmesh.toolcalls.formats import ToolFormat
from kvmesh.toolcalls.parse import parse_output
from kvmesh.toolcalls.stream import ArgsDelta, CallStart, TextDelta, ToolCallStream


class Splitter(Protocol):
    def feed(self, delta: str, out: OutputBuilder) -> None: ...

    def finish(self, out: OutputBuilder) -> None: ...


class PlainText:
    """No tool may be called: everything is text."""

    def feed(self, delta: str, out: OutputBuilder) -> None:
        out.add_text(delta)

    def finish(self, out: OutputBuilder) -> None:
        return None


class StreamedCalls:
    """Calls split out while the text streams."""

    def __init__(self, fmt: ToolFormat, names: list[str]) -> None:
        self.scan = ToolCallStream(fmt, names)

    def feed(self, delta: str, out: OutputBuilder) -> None:
        _apply(self.scan.feed(delta), out)

    def finish(self, out: OutputBuilder) -> None:
        _apply(self.scan.finish(), out)


def _apply(deltas: list[TextDelta | CallStart | ArgsDelta], out: OutputBuilder) -> None:
    for d in deltas:
        if isinstance(d, TextDelta):
            out.add_text(d.text)
        elif isinstance(d, CallStart):
            out.start_call(d.index, d.id, d.name)
        else:
            out.add_arguments(d.index, d.fragment)


@dataclass(slots=True)
class WholeCalls:
    """Calls split out of the finished text: the content first, then the calls, in order."""

    fmt: ToolFormat
    names: list[str]
    text: list[str] = field(default_factory=list)

    def feed(self, delta: str, out: OutputBuilder) -> None:
        self.text.append(delta)

    def finish(self, out: OutputBuilder) -> None:
        parsed = parse_output("".join(self.text), self.fmt, self.names)
        out.add_text(parsed.content)
        for i, call in enumerate(parsed.calls):
            out.start_call(i, call.id, call.name)
            out.add_arguments(i, call.arguments)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: tuple[FunctionTool, ...]
    mode: str  # "none" | "auto" | "required" | "named"
    fmt: ToolFormat
    constraint: Constraint | None = None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.template() for t in self.tools] or None

    @property
    def echo(self) -> list[dict[str, Any]]:
        return [t.model_dump() for t in self.tools]

    def splitter(self, stream: bool) -> Splitter:
        if self.mode == "none" or not self.tools:
            return PlainText()
        names = [t.name for t in self.tools]
        return StreamedCalls(self.fmt, names) if stream else WholeCalls(self.fmt, names)


def plan_tools(state: IngressState, body: ResponsesRequest) -> ToolPlan:
    tools = tuple(body.function_tools())
    raw = body.choice()
    choice = ToolChoice("named", raw.name) if isinstance(raw, ToolChoiceFunction) else ToolChoice(raw)
    schemas = [ToolSchema(name=t.name, parameters=t.schema()) for t in tools]
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    fmt = body.format
    answer = None
    if isinstance(fmt, FormatJsonSchema):
        answer = json_constraint(fmt.schema_)
    elif isinstance(fmt, FormatJsonObject):
        answer = json_constraint(None)
    constraint = request_constraint(schemas, choice, state.tool_format, parallel, answer, "text.format.schema")
    return ToolPlan(tools, choice.mode, state.tool_format, constraint)
