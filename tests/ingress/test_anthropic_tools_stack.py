"""Anthropic tool use end to end: the official `anthropic` SDK against a real stack.

tool_choice any / tool forces the tiny random model's output into calls
(shared/constrain/), so each answer must come back as `tool_use` blocks whose
input validates against the tool's input_schema, with stop_reason tool_use;
streamed, `input_json_delta` fragments must add up to the same input.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from kvmesh.stack.servers import S3Server

from ingress.serving_stack import ServingStack, one_of_each

KEYS = {"sk-anth-tools": "anth-tools"}
LOOKUP = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
          "required": ["query", "limit"]}
SEND = {"type": "object", "properties": {"to": {"type": "string", "enum": ["ops", "dev"]},
                                         "urgent": {"type": "boolean"}}, "required": ["to", "urgent"]}
SCHEMAS = {"lookup": LOOKUP, "send": SEND}
TOOLS = [{"name": n, "description": f"the {n} tool", "input_schema": s} for n, s in SCHEMAS.items()]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("anthropic-tools"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


@pytest.fixture
def client(stack: ServingStack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key="sk-anth-tools", max_retries=0, timeout=120)


def ask(stack: ServingStack, **kw: Any) -> dict[str, Any]:
    return {"model": stack.model_dir.name, "max_tokens": 160, "tools": TOOLS,
            "messages": [{"role": "user", "content": "Find the runbook and tell ops."}],
            "extra_body": {"temperature": 0}, **kw}


def check_uses(blocks: list[Any], allowed: set[str]) -> list[tuple[str, dict]]:
    uses = [(b.name, b.input) for b in blocks if b.type == "tool_use"]
    assert uses and all(b.id.startswith("toolu_") for b in blocks if b.type == "tool_use")
    for name, given in uses:
        assert name in allowed
        jsonschema.validate(given, SCHEMAS[name])
    return uses


def test_any_gives_tool_use_blocks_and_streams_the_same(client: anthropic.Anthropic, stack: ServingStack) -> None:
    msg = client.messages.create(**ask(stack, tool_choice={"type": "any"}))
    assert msg.stop_reason == "tool_use"
    uses = check_uses(msg.content, set(SCHEMAS))

    partial: dict[int, str] = {}
    with client.messages.stream(**ask(stack, tool_choice={"type": "any"})) as stream:
        for event in stream:
            if event.type == "content_block_start" and event.content_block.type == "tool_use":
                assert event.content_block.input == {}
                partial[event.index] = ""
            elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial[event.index] += event.delta.partial_json
        final = stream.get_final_message()
    assert [json.loads(p) for _, p in sorted(partial.items())] == [u[1] for u in uses]
    assert check_uses(final.content, set(SCHEMAS)) == uses and final.stop_reason == "tool_use"


def test_named_tool_without_parallel_use_is_one_call(client: anthropic.Anthropic, stack: ServingStack) -> None:
    for _ in range(4):  # sampled: any answer, forced, is a single call
        msg = client.messages.create(**ask(stack, tool_choice={"type": "tool", "name": "send",
                                                               "disable_parallel_tool_use": True},
                                           extra_body={"temperature": 1.0}))
        assert len(check_uses(msg.content, {"send"})) == 1


def test_raw_stream_events_open_a_tool_use_block(stack: ServingStack) -> None:
    body = {**ask(stack, tool_choice={"type": "tool", "name": "lookup"}), "stream": True, "temperature": 0}
    del body["extra_body"]
    with httpx.stream("POST", f"{stack.base_url}/v1/messages", json=body, timeout=120,
                      headers={"x-api-key": "sk-anth-tools"}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"] and kinds[-1] == "message_stop"
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert starts[0]["content_block"]["type"] == "tool_use" and starts[0]["index"] == 0
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [s["index"] for s in starts]  # every block stopped, in order
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["tool_use"]
