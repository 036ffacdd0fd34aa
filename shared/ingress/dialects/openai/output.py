"""A chat completion's output as OpenAI shapes it: content and `tool_calls`, whole or as chunk deltas.

When the request offered tools and `tool_choice` is not "none", the output runs
through the tool-call scanner (shared/toolcalls/): calls become `tool_calls`
entries (`{id, type: "function", function: {name, arguments}}`), the rest is
`content`, which is null when only whitespace is left beside calls. A stream
sends, per call, one delta with `index`, `id`, `type` and `function.name` (empty
arguments), then `function.arguments` fragments with the same `index`. Calls
make `finish_reason` "tool_calls" unless the output was cut (`length` stays).
"""

from __future__ import annotations

from typing import Any

from kvmesh.ingress.dialects.tool_choice import ToolParsing
from kvmesh.toolcalls.parse import parse_output
from kvmesh.toolcalls.stream import ArgsDelta, CallStart, TextDelta, ToolCallStream

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def finish_reason(finish: str | None, has_calls: bool) -> str | None:
    if finish is None:
        return None
    reason = FINISH.get(finish, finish)
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_message(text: str, parsing: ToolParsing | None) -> tuple[dict[str, Any], list[str]]:
    """(the `message` of a non-streaming choice, the names of the tools it calls)."""
    if parsing is None:
        return {"role": "assistant", "content": text, "refusal": None}, []
    out = parse_output(text, parsing.fmt, parsing.names)
    message: dict[str, Any] = {"role": "assistant", "content": out.content if out.content.strip() or not out.calls
                               else None, "refusal": None}
    if out.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in out.calls]
    return message, [c.name for c in out.calls]


class ChatDeltas:
    """Text deltas of a streamed chat answer -> the `delta` objects of its chunks."""

    def __init__(self, parsing: ToolParsing | None) -> None:
        self._stream = None if parsing is None else ToolCallStream(parsing.fmt, parsing.names)
        self.called: list[str] = []  # names of the calls streamed so far

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._stream is None:
            return [{"content": text}] if text else []
        return self._deltas(self._stream.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        return [] if self._stream is None else self._deltas(self._stream.finish())

    def _deltas(self, found: list[TextDelta | CallStart | ArgsDelta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in found:
            if isinstance(d, TextDelta):
                out.append({"content": d.text})
            elif isinstance(d, CallStart):
                self.called.append(d.name)
                out.append({"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                            "function": {"name": d.name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": d.index, "function": {"arguments": d.fragment}}]})
        return out
