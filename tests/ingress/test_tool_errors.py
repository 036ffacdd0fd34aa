"""Bad tools, tool_choice and response_format: a 400 in the route's dialect, and nothing queued.

The ingress runs with no workers (a valid request is the 503 / 529 case), and
the JOBS stream's last sequence staying put proves no job was published.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from ingress.serving_stack import ServingStack, ingress_alone, no_job_published

KEY = "sk-tool-errors"
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServingStack]:
    with ingress_alone(tmp_path_factory.mktemp("tool-errors"), tiny_model_dir, {KEY: "acme"}) as s:
        yield s


@pytest.fixture
def no_jobs(stack: ServingStack) -> Iterator[None]:
    with no_job_published(stack):
        yield


def chat(stack: ServingStack, **kw: Any) -> Any:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0)
    args = {"model": stack.model_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    return client.chat.completions.create(**args)


def message(stack: ServingStack, **kw: Any) -> Any:
    client = anthropic.Anthropic(base_url=stack.base_url, api_key=KEY, max_retries=0)
    args = {"model": stack.model_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    return client.messages.create(**args)


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}

OPENAI_CASES = {
    "invalid json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": BAD_SCHEMA}}}, "response_format"),
    "unknown response_format": ({"response_format": {"type": "xml"}}, "response_format"),
    "unknown tool named": ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}},
                           "tool_choice"),
    "bad tool_choice": ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    "required without tools": ({"tool_choice": "required"}, "tool_choice"),
    "bad tool name": ({"tools": [{"type": "function", "function": {"name": "add two"}}]}, "tools"),
    "parameters not an object": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    "invalid parameters schema": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": BAD_SCHEMA}}], "tool_choice": "required"}, "tools"),
}


@pytest.mark.parametrize("case", sorted(OPENAI_CASES))
def test_openai_rejects_before_queueing(stack: ServingStack, no_jobs: None, case: str) -> None:
    kw, param = OPENAI_CASES[case]
    with pytest.raises(openai.BadRequestError) as err:
        chat(stack, extra_body=kw)
    assert err.value.status_code == 400 and err.value.param == param
    assert err.value.type == "invalid_request_error"


ANTHROPIC_TOOLS = [{"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]
ANTHROPIC_CASES = {
    "unknown tool named": {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "send"}},
    "tool without a name": {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}},
    "bad tool_choice type": {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "sometimes"}},
    "any without tools": {"tool_choice": {"type": "any"}},
    "invalid input_schema": {"tools": [{"name": "f", "input_schema": BAD_SCHEMA}], "tool_choice": {"type": "any"}},
}


@pytest.mark.parametrize("case", sorted(ANTHROPIC_CASES))
def test_anthropic_rejects_before_queueing(stack: ServingStack, no_jobs: None, case: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        message(stack, extra_body=ANTHROPIC_CASES[case])
    assert err.value.status_code == 400
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"


def test_valid_tool_requests_pass_the_checks(stack: ServingStack) -> None:
    """The same requests made valid get past validation to the missing workers (the 503 / 529)."""
    with pytest.raises(openai.InternalServerError) as err:
        chat(stack, tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}},
             response_format={"type": "json_object"})
    assert err.value.status_code == 503
    with pytest.raises(anthropic.APIStatusError) as aerr:
        message(stack, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "lookup"})
    assert aerr.value.status_code == 529
