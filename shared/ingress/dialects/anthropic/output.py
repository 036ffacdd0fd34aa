"""A message's output as Anthropic shapes it: a text block and `tool_use` blocks, whole or as stream events.

When the request offered tools and tool_choice is not "none", the output runs
through the tool-call scanner (shared/toolcalls/): each call is a `tool_use`
block (`id` "toolu_...", `name`, `input` object) after the text block, which is
left out when only whitespace is left beside calls. Streamed, blocks open as
their content appears: a `text` block at the first text, a `tool_use` block
(`input` {}) at each call, whose arguments follow as `input_json_delta`
(`partial_json`) fragments; each block is stopped before the next starts. An
output with no content at all still has one (empty) text block. Calls make the
stop_reason `tool_use` unless the output was cut (`max_tokens`) or hit a stop
sequence.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.ingress.dialects.tool_choice import ToolParsing
from kvmesh.toolcalls.parse import parse_output
from kvmesh.toolcalls.stream import (
    ArgsDelta,
    CallStart,
    Delta,
    TextDelta,
    ToolCallStream,
)

Event = tuple[str, dict[str, Any]]  # (SSE event name, data)


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a parsed call (`call_<hex>` -> `toolu_<hex>`)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason_with_calls(reason: str, has_calls: bool) -> str:
    return "tool_use" if has_calls and reason == "end_turn" else reason


def content_blocks(text: str, parsing: ToolParsing | None) -> tuple[list[dict[str, Any]], list[str]]:
    """(the message's content blocks, the names of the tools it calls)."""
    if parsing is None:
        return [{"type": "text", "text": text}], []
    out = parse_output(text, parsing.fmt, parsing.names)
    blocks: list[dict[str, Any]] = []
    if out.content.strip() or not out.calls:
        blocks.append({"type": "text", "text": out.content})
    blocks += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": json.loads(c.arguments)}
               for c in out.calls]
    return blocks, [c.name for c in out.calls]


class BlockEvents:
    """Text deltas of a streamed message -> its content block events (see the module docstring)."""

    def __init__(self, parsing: ToolParsing | None) -> None:
        self._stream = None if parsing is None else ToolCallStream(parsing.fmt, parsing.names)
        self._index = -1  # the open block's index
        self._open: str | None = None  # its type
        self.called: list[str] = []

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        return self._events([TextDelta(text)] if self._stream is None else self._stream.feed(text))

    def finish(self) -> list[Event]:
        """The remaining deltas and the last block's stop (an empty text block if none was opened)."""
        events = [] if self._stream is None else self._events(self._stream.finish())
        if self._open is None:
            events += self._start({"type": "text", "text": ""})
        return [*events, ("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _events(self, deltas: list[Delta]) -> list[Event]:
        out: list[Event] = []
        for d in deltas:
            if isinstance(d, TextDelta):
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d.text}))
            elif isinstance(d, CallStart):
                self.called.append(d.name)
                out += self._start({"type": "tool_use", "id": tool_use_id(d.id), "name": d.name, "input": {}})
            elif isinstance(d, ArgsDelta):
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.fragment}))
        return out

    def _start(self, block: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        if self._open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._index += 1
        self._open = block["type"]
        out.append(("content_block_start", {"type": "content_block_start", "index": self._index,
                                             "content_block": block}))
        if self._index == 0:
            out.append(("ping", {"type": "ping"}))
        return out

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}
