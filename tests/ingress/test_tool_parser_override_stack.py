"""ingress.tool_parser overrides the template's format: the Llama-template tiny model, forced and parsed as Hermes.

The prompt still says the Llama 3 syntax; what the model writes is forced in
`<tool_call>` tags, so the calls coming back at all prove the setting reached
both the constraint and the parser.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvmesh.stack.servers import S3Server

from ingress.serving_stack import ServingStack, one_of_each

KEY = "sk-hermes"
TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"host": {"type": "string", "enum": ["a", "b"]}}, "required": ["host"],
    "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("tool-parser"), s3_server, tiny_model_dir, {KEY: "hermes"},
                     KVMESH_INGRESS__TOOL_PARSER="hermes") as s:
        yield s


def test_hermes_calls_forced_and_parsed(stack: ServingStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    args = {"model": stack.model_dir.name, "max_tokens": 120, "temperature": 0, "tools": TOOLS,
            "tool_choice": "required", "messages": [{"role": "user", "content": "ping a"}]}
    whole = client.chat.completions.create(**args)
    calls = whole.choices[0].message.tool_calls or []
    assert calls and all(c.function.name == "ping" and json.loads(c.function.arguments)["host"] in "ab"
                         for c in calls)
    with client.chat.completions.stream(**args) as s:
        final = s.get_final_completion()
    assert [c.function.arguments for c in final.choices[0].message.tool_calls or []] == \
        [c.function.arguments for c in calls]
