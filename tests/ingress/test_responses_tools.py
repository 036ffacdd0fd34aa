"""Tool calls and structured output through /v1/responses on a real stack, and one OpenAI Agents SDK run.

The model is a random tiny one: only grammar-forced output has a guaranteed
shape, so every check here is on forced output (tool_choice "required" or a
named function, text.format json_schema with no tool callable). Forced calls
run with parallel_tool_calls off, so the grammar ends the answer after one call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from kvmesh.stack.servers import S3Server
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from ingress.serving_stack import ServingStack, job_count, one_of_each

pytestmark = pytest.mark.timeout(300)

KEY = "sk-resp-tools"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast for a city.", "strict": True,
          "parameters": WEATHER},
         {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {},
                                                             "additionalProperties": False}}]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
FORCED = 600  # output tokens a forced answer may take (its grammar ends it well before)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("responses-tools"), s3_server, tiny_model_dir, {KEY: "tools"}) as s:
        yield s


def client(stack: ServingStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_required_call_then_its_output_then_a_json_answer(stack: ServingStack) -> None:
    c = client(stack)
    r = c.responses.create(model=stack.model_dir.name, input="What is the weather in Oslo this week?",
                           tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=FORCED)
    assert r.status == "completed"
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])

    answer = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 20}},
              "required": ["summary"], "additionalProperties": False}
    follow = c.responses.create(
        model=stack.model_dir.name, previous_response_id=r.id, tools=TOOLS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        text={"format": {"type": "json_schema", "name": "answer", "schema": answer, "strict": True}},
        max_output_tokens=FORCED)
    assert follow.status == "completed" and [o.type for o in follow.output] == ["message"]
    jsonschema.validate(json.loads(follow.output_text), answer)
    assert follow.text.format.type == "json_schema"
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the call turn is the prompt's prefix


def test_named_call_streams_its_arguments(stack: ServingStack) -> None:
    body = {"model": stack.model_dir.name, "input": "Forecast for Bergen.", "tools": TOOLS, "stream": True,
            "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
            "max_output_tokens": FORCED}
    with httpx.stream("POST", f"{stack.base_url}/v1/responses", json=body, timeout=120,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        frames = [f for f in r.read().decode().split("\n\n") if f.strip()]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(f.split("\n")[1].removeprefix("data: "))) for f in frames]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    n = kinds.count("response.function_call_arguments.delta")
    assert n >= 1 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                *["response.function_call_arguments.delta"] * n,
                                "response.function_call_arguments.done", "response.output_item.done",
                                "response.completed"]
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-3].arguments
    final = events[-1].response.output[0]
    assert streamed == done == final.arguments and final.name == "get_weather"
    jsonschema.validate(json.loads(done), WEATHER)
    assert events[2].item.id == final.id == events[-3].item_id


@pytest.mark.parametrize(("extra", "param"), [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}], "tool_choice": "required"}, "tools"),
])
def test_schemas_the_grammar_refuses_are_400(stack: ServingStack, extra: dict, param: str) -> None:
    before = asyncio.run(job_count(stack.nats.url))
    r = httpx.post(f"{stack.base_url}/v1/responses", json={"model": stack.model_dir.name, "input": "hi", **extra},
                   headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert asyncio.run(job_count(stack.nats.url)) == before


def test_an_agents_sdk_run_calls_its_tool(stack: ServingStack) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[dict] = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """The forecast for a city.

        Args:
            city: The city.
            days: How many days ahead.
        """
        calls.append({"city": city, "days": days})
        return f"{city}: sunny for {days} days"

    async def run() -> object:
        client_ = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
        agent = Agent(
            name="forecaster", instructions="Answer with the forecast tool.", tools=[get_weather],
            model=OpenAIResponsesModel(model=stack.model_dir.name, openai_client=client_),
            model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=FORCED),
            tool_use_behavior="stop_on_first_tool")  # the tool's answer ends the run: no free (random) turn
        try:
            return await Runner.run(agent, "Weather in Oslo for the next days?", max_turns=3)
        finally:
            await client_.close()

    result = asyncio.run(run())
    assert len(calls) == 1 and result.final_output == f"{calls[0]['city']}: sunny for {calls[0]['days']} days"
    jsonschema.validate(calls[0], get_weather.params_json_schema)
    assert 1 <= len(result.raw_responses) <= 3
    [response] = result.raw_responses
    assert [o.type for o in response.output] == ["function_call"]
