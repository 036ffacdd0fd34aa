"""What a Responses request's tools, `tool_choice` and `text.format` mean for its prompt, decoding and output.

`plan_tools` validates them (a bad one is a 400 naming it, before anything
is published) and returns a `ToolPlan`: the tools in the shape chat
templates render, the tools as the response echoes them, the decoding
`Constraint` (none for "auto" text; a grammar forcing a call for "required"
or a named function; a JSON schema for `text.format`), and `splitter()`,
which separates the model's tool-call syntax from its text as it streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from shared.ingress.admission import IngressState
from shared.ingress.errors import invalid
from shared.ingress.responses_models import FunctionTool, ResponsesRequest, ToolChoiceFunction
from shared.ingress.responses_stream import OutputBuilder
from shared.protocol.serving import Constraint


class Splitter(Protocol):
    def feed(self, delta: str, out: OutputBuilder) -> None: ...

    def finish(self, out: OutputBuilder) -> None: ...


class PlainText:
    """No tools offered (or `tool_choice: none`): everything is text."""

    def feed(self, delta: str, out: OutputBuilder) -> None:
        out.add_text(delta)

    def finish(self, out: OutputBuilder) -> None:
        return None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: tuple[FunctionTool, ...]
    mode: str  # "none" | "auto" | "required" | "function"
    constraint: Constraint | None = None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.template() for t in self.tools] or None

    @property
    def echo(self) -> list[dict[str, Any]]:
        return [t.model_dump() for t in self.tools]

    def splitter(self) -> Splitter:
        return PlainText()


def plan_tools(state: IngressState, body: ResponsesRequest) -> ToolPlan:
    tools = tuple(body.function_tools())
    choice = body.choice()
    if isinstance(choice, ToolChoiceFunction):
        if choice.name not in {t.name for t in tools}:
            raise invalid(f"tool_choice: no tool named {choice.name!r} in tools", param="tool_choice")
        mode = "function"
    else:
        mode = choice
    if mode == "required" and not tools:
        raise invalid("tool_choice: 'required' needs at least one tool", param="tool_choice")
    return ToolPlan(tools, mode)
