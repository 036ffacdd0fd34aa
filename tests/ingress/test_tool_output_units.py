"""Tool calls as each dialect returns them, from outputs a model may write unforced (tool_choice auto)."""

from __future__ import annotations

import json

from kvmesh.ingress.dialects.anthropic.output import (
    BlockEvents,
    content_blocks,
    stop_reason_with_calls,
)
from kvmesh.ingress.dialects.openai.output import (
    ChatDeltas,
    chat_message,
    finish_reason,
)
from kvmesh.ingress.dialects.tool_choice import ToolChoice, ToolParsing, tool_parsing
from kvmesh.protocol.serving import ToolSchema
from kvmesh.toolcalls.formats import HERMES, LLAMA3_JSON

PARSING = ToolParsing(HERMES, ("get_weather",))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
OUTPUT = "Let me check.\n" + CALL


def test_parsing_only_with_tools_and_not_none() -> None:
    tools = [ToolSchema(name="f")]
    assert tool_parsing([], ToolChoice("auto"), HERMES) is None
    assert tool_parsing(tools, ToolChoice("none"), HERMES) is None
    assert tool_parsing(tools, ToolChoice("auto"), LLAMA3_JSON) == ToolParsing(LLAMA3_JSON, ("f",))


def test_openai_message_with_text_and_a_call() -> None:
    message, called = chat_message(OUTPUT, PARSING)
    assert called == ["get_weather"] and message["content"] == "Let me check.\n"
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert chat_message(CALL, PARSING)[0]["content"] is None
    assert chat_message(CALL, None) == ({"role": "assistant", "content": CALL, "refusal": None}, [])
    assert finish_reason("stop", True) == "tool_calls" and finish_reason("length", True) == "length"


def test_openai_deltas_stream_the_same_message() -> None:
    deltas = ChatDeltas(PARSING)
    out = [d for ch in OUTPUT for d in deltas.feed(ch)] + deltas.finish()
    assert "".join(d.get("content", "") for d in out) == "Let me check.\n"
    calls = [d["tool_calls"][0] for d in out if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["index"] == 0
    assert all(set(c) == {"index", "function"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert deltas.called == ["get_weather"]


def test_anthropic_blocks_text_then_tool_use() -> None:
    blocks, called = content_blocks(OUTPUT, PARSING)
    assert [b["type"] for b in blocks] == ["text", "tool_use"] and called == ["get_weather"]
    assert blocks[1]["id"].startswith("toolu_") and blocks[1]["input"] == {"city": "Oslo"}
    assert [b["type"] for b in content_blocks(CALL, PARSING)[0]] == ["tool_use"]
    assert stop_reason_with_calls("end_turn", True) == "tool_use"
    assert stop_reason_with_calls("max_tokens", True) == "max_tokens"


def test_anthropic_events_open_a_block_per_content() -> None:
    events = BlockEvents(PARSING)
    out = [e for ch in OUTPUT + "\nDone." for e in events.feed(ch)] + events.finish()
    shape = [(name, data.get("index"), (data.get("content_block") or data.get("delta") or {}).get("type"))
             for name, data in out if name != "content_block_delta"]
    assert shape == [("content_block_start", 0, "text"), ("ping", None, None), ("content_block_stop", 0, None),
                     ("content_block_start", 1, "tool_use"), ("content_block_stop", 1, None),
                     ("content_block_start", 2, "text"), ("content_block_stop", 2, None)]
    partial = "".join(d["delta"]["partial_json"] for n, d in out
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Oslo"}


def test_anthropic_empty_output_still_has_a_text_block() -> None:
    names = [n for n, _ in BlockEvents(None).finish()]
    assert names == ["content_block_start", "ping", "content_block_stop"]
