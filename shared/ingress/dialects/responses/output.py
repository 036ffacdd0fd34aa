"""The objects `/v1/responses` answers with: the `response`, its output items, usage, and the SSE events.

Shapes follow the OpenAI API as the official SDK's types declare them
(`openai/types/responses/`), so `client.responses.create/stream/retrieve`
parse every field. The request's settings are echoed back on the response,
as OpenAI does. Streaming: each event is an SSE frame whose `event:` name
equals its `type`, numbered by `sequence_number` from 0 (`EventWriter`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvmesh.ingress.core.sse import sse
from kvmesh.ingress.core.types import Usage
from kvmesh.ingress.dialects.responses.models import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)] if status != "in_progress" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage_of(usage: Usage, output_tokens: int, block_size: int) -> dict[str, Any]:
    """`cache_write_tokens`: the prompt's full blocks this request computed (the workers keep them)."""
    written = max(0, usage.prompt_tokens // block_size * block_size - usage.cached_tokens)
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": written},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + output_tokens}


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.choice()
    return choice if isinstance(choice, str) else choice.model_dump()


def _text(body: ResponsesRequest) -> dict[str, Any]:
    fmt = body.format
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


@dataclass(slots=True)
class ResponseDraft:
    """One response being built: its id, the echoed request settings, and the output so far."""

    id: str
    created_at: int
    model: str
    body: ResponsesRequest
    tools: list[dict[str, Any]]  # the function tools as echoed (type, name, description, parameters, strict)
    output: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] | None = None  # the finished `response` object, once there is one

    def envelope(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete_reason: str | None = None) -> dict[str, Any]:
        """The `response` object in `status`; `output` is what has been produced so far."""
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "max_tool_calls": None,
            "model": self.model, "output": list(self.output),
            "parallel_tool_calls": b.parallel_tool_calls if b.parallel_tool_calls is not None else True,
            "previous_response_id": b.previous_response_id, "prompt_cache_key": b.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "safety_identifier": b.safety_identifier,
            "service_tier": "default", "store": b.store,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "text": _text(b), "tool_choice": _tool_choice(b), "tools": self.tools, "top_logprobs": 0,
            "top_p": b.top_p if b.top_p is not None else 1.0, "truncation": "disabled",
            "usage": usage, "user": b.user, "metadata": b.metadata or {},
        }


class EventWriter:
    """SSE frames of one stream: `event: <type>`, the payload with its `type` and `sequence_number`."""

    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, type_: str, **fields: Any) -> bytes:
        frame = sse({"type": type_, "sequence_number": self.seq, **fields}, event=type_)
        self.seq += 1
        return frame
