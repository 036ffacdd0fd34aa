"""Responses items -> the chat-template messages every dialect renders (and so the same prompt prefixes).

A `message` item is a message (`developer` speaks as `system`); consecutive
`function_call` items become one assistant message with `tool_calls` in the
chat-completions shape (merged into the assistant text right before them,
as the model produced both in one turn); a `function_call_output` becomes a
`tool` message answering its `call_id`, which must name a call earlier in
the conversation (OpenAI rejects an orphan output the same way).
Instructions are the first system message; they are never stored, so a
follow-up states its own, as OpenAI documents.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvmesh.ingress.core.errors import invalid
from kvmesh.ingress.dialects.responses.models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
)

AnyItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


def _arguments(text: str) -> Any:
    """HF chat templates render an arguments object; text that is not JSON stays text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def to_messages(instructions: str | None, history: Sequence[AnyItem], new: Sequence[AnyItem],
                param: str = "input") -> list[dict[str, Any]]:
    """Messages of `instructions` + `history` (a stored conversation) + `new` (this request's input).

    An orphan `function_call_output` in `new` is a 400 naming it (`input[i].call_id`)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}
    for pos, item in enumerate([*history, *new]):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item.arguments)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            if item.call_id not in names:
                where = f"{param}[{pos - len(history)}].call_id" if pos >= len(history) else "previous_response_id"
                raise invalid(f"{where}: no function_call with call_id {item.call_id!r} precedes this output",
                              param=where)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "name": names[item.call_id],
                             "content": item.text()})
    return messages


def stored(item: AnyItem) -> dict[str, Any]:
    """An item as it is stored and read back (the same validation parses it again)."""
    return item.model_dump(mode="json", by_alias=True)
