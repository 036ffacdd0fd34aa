"""A finished output as text content and tool calls (the non-streaming path).

`parse_output` runs the streaming scanner (shared/toolcalls/stream.py) over the
whole text, so both paths find the same calls at the same places. With the whole
text in hand it can also refuse what a stream cannot take back: a call whose
arguments are not a complete JSON object (cut short by max tokens, malformed)
stays text, in place. Content is the output with the calls' text (opener, JSON,
closer, and whitespace/separator before a following call) removed, nothing else
changed; whether whitespace-only content counts as none is the dialect's call.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

from kvmesh.toolcalls.formats import ToolFormat
from kvmesh.toolcalls.stream import StreamedCall, ToolCallStream


@dataclass(slots=True)
class ToolCall:
    id: str  # call_<24 hex>
    name: str
    arguments: str  # the JSON text of the arguments object, as the model wrote it


@dataclass(slots=True)
class ParsedOutput:
    content: str
    calls: list[ToolCall]


def parse_output(text: str, fmt: ToolFormat, tool_names: Collection[str] | None = None) -> ParsedOutput:
    """Split `text` into content and well-formed calls of `tool_names` (any name when None)."""
    stream = ToolCallStream(fmt, tool_names)
    stream.feed(text)
    stream.finish()
    calls = [c for c in stream.calls if well_formed(c)]
    content: list[str] = []
    at = 0
    for call in calls:
        content.append(text[at:call.start])
        at = call.end
    content.append(text[at:])
    return ParsedOutput("".join(content), [ToolCall(c.id, c.name, c.arguments) for c in calls])


def well_formed(call: StreamedCall) -> bool:
    """Its object closed, was JSON, and its arguments are a JSON object."""
    if not call.complete or call.malformed:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except json.JSONDecodeError:
        return False
