"""OpenAI structured outputs end to end: response_format forces the answer's JSON (official SDK, real stack).

From a random tiny model, only the grammar can make the content JSON, so
every answer parsing and validating is the proof the constraint reached the
workers and held.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from kvmesh.stack.servers import S3Server
from pydantic import BaseModel, Field

from ingress.serving_stack import ServingStack, one_of_each

KEYS = {"sk-json": "json"}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


class Ticket(BaseModel):
    title: str = Field(max_length=20)
    priority: Literal["low", "high"]
    estimate_hours: int


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("structured"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


@pytest.fixture
def client(stack: ServingStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-json", max_retries=0, timeout=120)


def ask(stack: ServingStack, **kw: Any) -> dict[str, Any]:
    return {"model": stack.model_dir.name, "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": "Describe a person as JSON."}], **kw}


def test_json_object_is_a_json_object(client: openai.OpenAI, stack: ServingStack) -> None:
    r = client.chat.completions.create(**ask(stack, response_format={"type": "json_object"}))
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_json_schema_strict_validates_whole_and_streamed(client: openai.OpenAI, stack: ServingStack) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(**ask(stack, response_format=fmt))
    content = r.choices[0].message.content or ""
    jsonschema.validate(json.loads(content), PERSON)
    chunks = list(client.chat.completions.create(**ask(stack, response_format=fmt), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content


def test_parse_with_a_pydantic_model_returns_an_instance(client: openai.OpenAI, stack: ServingStack) -> None:
    r = client.chat.completions.parse(**ask(stack, response_format=Ticket, temperature=1.0, seed=3))
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Ticket) and parsed.priority in ("low", "high")


def test_tool_choice_required_wins_over_response_format(client: openai.OpenAI, stack: ServingStack) -> None:
    tools = [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}]
    r = client.chat.completions.create(**ask(stack, response_format={"type": "json_object"}, tools=tools,
                                             tool_choice="required", parallel_tool_calls=False))
    calls = r.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("noop", {})]
