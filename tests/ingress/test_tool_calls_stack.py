"""OpenAI chat tool calls end to end: the official SDK against a real stack (nats + S3 + prefill + decode + ingress).

The tiny model is random, so only what the grammar forces is certain: with
tool_choice "required" or a named function its output is calls of the offered
tools whose arguments match their schemas, and the ingress must hand them back
as `tool_calls`, whole or streamed. What it writes unforced (tool_choice auto)
is covered by the parser's unit tests (tests/toolcalls/).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import nats
import openai
import pytest
from kvmesh.protocol import subjects
from kvmesh.sessions.events import SessionEvent, TurnOutcome
from kvmesh.stack.servers import S3Server
from nats.js import api

from ingress.serving_stack import ServingStack, one_of_each

KEYS = {"sk-tools": "tools"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": p}}
         for n, p in SCHEMAS.items()]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("tool-calls"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


@pytest.fixture
def client(stack: ServingStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-tools", max_retries=0, timeout=120)


def ask(stack: ServingStack, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"model": stack.model_dir.name, "max_tokens": 160, "temperature": 0, "tools": TOOLS,
                            "messages": [{"role": "user", "content": "What is the weather in Oslo? And 2 + 3?"}]}
    return {**args, **kw}


def check_calls(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    """Every call names an offered tool and its arguments are a JSON object valid against that tool's schema."""
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_gives_valid_calls_and_streams_the_same(client: openai.OpenAI, stack: ServingStack) -> None:
    whole = client.chat.completions.create(**ask(stack, tool_choice="required"))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    check_calls([(c.function.name, c.function.arguments) for c in calls], set(SCHEMAS))
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == len(calls)

    chunks = list(client.chat.completions.create(**ask(stack, tool_choice="required"), stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed: dict[int, dict[str, str]] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            if d.index not in streamed:  # a call's first delta names it
                assert d.id and d.id.startswith("call_") and d.type == "function" and d.function.name
                streamed[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None
                streamed[d.index]["arguments"] += d.function.arguments or ""
    assert sorted(streamed) == list(range(len(streamed)))
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]
    assert all(not ch.choices[0].delta.content for ch in chunks)


def test_named_function_is_the_only_one_called(client: openai.OpenAI, stack: ServingStack) -> None:
    choice = {"type": "function", "function": {"name": "add"}}
    whole = client.chat.completions.create(**ask(stack, tool_choice=choice))
    calls = whole.choices[0].message.tool_calls or []
    check_calls([(c.function.name, c.function.arguments) for c in calls], {"add"})
    # the SDK's stream helper accumulates the deltas into the same message
    with client.chat.completions.stream(**ask(stack, tool_choice=choice)) as stream:
        final = stream.get_final_completion()
    got = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in got] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_parallel_calls_only_when_allowed(client: openai.OpenAI, stack: ServingStack) -> None:
    """Sampled with seeds, some answer makes several calls when parallel calls are allowed; none does when not."""
    def counts(parallel: bool) -> list[int]:
        out = []
        for seed in range(6):
            r = client.chat.completions.create(**ask(stack, tool_choice="required", temperature=1.0, seed=seed,
                                                     parallel_tool_calls=parallel))
            calls = r.choices[0].message.tool_calls or []
            check_calls([(c.function.name, c.function.arguments) for c in calls], set(SCHEMAS))
            out.append(len(calls))
        return out

    assert max(counts(True)) >= 2
    assert counts(False) == [1] * 6


def test_none_leaves_the_output_as_text(client: openai.OpenAI, stack: ServingStack) -> None:
    r = client.chat.completions.create(**ask(stack, tool_choice="none", max_tokens=8))
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(r.choices[0].message.content, str)


def test_the_session_event_names_the_called_tools(client: openai.OpenAI, stack: ServingStack) -> None:
    r = client.chat.completions.with_raw_response.create(
        **ask(stack, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        extra_headers={"x-session-id": "tools-session-1"})
    assert r.parse().choices[0].message.tool_calls
    request_id = "req_" + r.parse().id.removeprefix("chatcmpl-")
    event = asyncio.run(_event(stack.nats.url, request_id))
    assert event.outcome is TurnOutcome.TOOL_CALLS and event.tools == ["get_weather"]


async def _event(url: str, request_id: str) -> SessionEvent:
    """The session event of `request_id` (TimeoutError if it never comes)."""
    nc = await nats.connect(url)
    try:
        sub = await nc.jetstream().pull_subscribe(subjects.SESSION_EVENTS, stream="SESSIONS", config=api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.ALL, ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0))
        async with asyncio.timeout(60):
            while True:
                try:
                    msgs = await sub.fetch(100, timeout=1.0)
                except nats.errors.TimeoutError:
                    continue
                for msg in msgs:
                    if (event := SessionEvent.from_bytes(msg.data)).request_id == request_id \
                            and event.outcome is not TurnOutcome.STARTED:  # the turn's end, not its start
                        return event
    finally:
        await nc.close()
