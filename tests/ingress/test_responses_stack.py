"""The Responses API end to end on a real stack (nats + S3 + prefill + decode + ingress), with the `openai` SDK.

Text responses and their stored copies, every streaming event checked
against the SDK's own types, follow-ups through `previous_response_id`
(prefix cache hit, session kept, instructions not inherited), `store:
false`, tenant isolation, errors that publish nothing, function_call items
in the input, and a stored response that outlives the ingress process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from kvmesh.config import EngineSettings
from kvmesh.stack.servers import S3Server
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from ingress.serving_stack import ServingStack, no_job_published, one_of_each

KEYS = {"sk-resp-a": "resp-a", "sk-resp-b": "resp-b"}
BLOCK = EngineSettings().block_size
RULES = ("You are the build agent of the kvmesh repository. You answer in one short line and never "
         "apologise. You run the tests before you claim anything works. ") * 3
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("responses-stack"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


def client(stack: ServingStack, key: str = "sk-resp-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture
def no_jobs(stack: ServingStack) -> Iterator[None]:
    with no_job_published(stack):
        yield


def create(stack: ServingStack, **kw: object) -> Response:
    args: dict[str, object] = {"model": stack.model_dir.name, "max_output_tokens": 8}
    args.update(kw)
    return client(stack).responses.create(**args)  # type: ignore[arg-type]


def test_text_response_is_stored_and_retrievable(stack: ServingStack) -> None:
    r = create(stack, input="Say hello.", instructions=RULES, metadata={"ticket": "13"})
    Response.model_validate(r.model_dump())  # every field the SDK requires is really there
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.instructions == RULES and r.metadata == {"ticket": "13"} and r.store is True
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text
    u = r.usage
    assert u.input_tokens > 30 and 1 <= u.output_tokens <= 8 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == 8
    got = client(stack).responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.input_tokens == u.input_tokens


def test_stream_events_follow_the_sdk_types(stack: ServingStack) -> None:
    body = {"model": stack.model_dir.name, "input": "Count to three.", "max_output_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/responses", json=body, timeout=60,
                      headers={"authorization": "Bearer sk-resp-a"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f.strip()]
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", kinds[-1]]
    final = events[-1].response
    assert kinds[-1] == f"response.{final.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text == events[-4].text
    assert final.usage.output_tokens >= 1

    # the SDK's stream helper parses the same events (its get_final_response wants response.completed,
    # which a reply cut at max_output_tokens does not end with: OpenAI sends response.incomplete too)
    with client(stack).responses.stream(model=stack.model_dir.name, input="Count to three.",
                                        max_output_tokens=6) as s:
        seen = list(s)
    done = seen[-1].response
    assert seen[0].type == "response.created" and seen[-1].type == f"response.{done.status}"
    assert done.output_text and done.id.startswith("resp_")
    assert client(stack).responses.retrieve(done.id).output_text == done.output_text


def test_follow_up_continues_the_session_from_the_cache(stack: ServingStack) -> None:
    c = client(stack)
    raw = c.responses.with_raw_response.create(model=stack.model_dir.name, instructions=RULES, max_output_tokens=8,
                                               input="Which tests run first?")
    first, session = raw.parse(), raw.headers["x-session-id"]
    raw2 = c.responses.with_raw_response.create(model=stack.model_dir.name, instructions=RULES,
                                                max_output_tokens=8, previous_response_id=first.id,
                                                input="And after that?")
    second = raw2.parse()
    assert raw2.headers["x-session-id"] == session  # the stored conversation is the session
    assert second.previous_response_id == first.id
    # the whole first turn (instructions, question, answer) is a prefix of the second prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // BLOCK - 1) * BLOCK > 0
    # instructions are not inherited: without them, the prompt is the conversation alone
    third = c.responses.create(model=stack.model_dir.name, max_output_tokens=4, previous_response_id=second.id,
                               input="Thanks.")
    assert third.instructions is None and third.usage.input_tokens < second.usage.input_tokens


def test_store_false_cannot_be_continued(stack: ServingStack) -> None:
    r = create(stack, input="Forget this.", store=False)
    assert r.store is False and r.output_text is not None
    with pytest.raises(openai.NotFoundError):
        client(stack).responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        create(stack, input="And?", previous_response_id=r.id)
    assert err.value.param == "previous_response_id"


def test_tenants_never_see_each_others_responses(stack: ServingStack) -> None:
    r = create(stack, input="A secret of tenant a.")
    b = client(stack, "sk-resp-b")
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        b.responses.create(model=stack.model_dir.name, input="Tell me.", previous_response_id=r.id)
    assert err.value.param == "previous_response_id"
    assert client(stack).responses.retrieve(r.id).id == r.id  # b's delete did nothing
    client(stack).responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client(stack).responses.retrieve(r.id)


def test_function_call_items_round_trip(stack: ServingStack) -> None:
    tools = [{"type": "function", "name": "run_tests", "description": "Run a test file.", "strict": True,
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                             "required": ["path"], "additionalProperties": False}}]
    history = [{"role": "user", "content": "Run the ingress tests."},
               {"type": "function_call", "call_id": "call_1", "name": "run_tests",
                "arguments": json.dumps({"path": "tests/ingress"})},
               {"type": "function_call_output", "call_id": "call_1", "output": "42 passed"}]
    r = create(stack, input=history, tools=tools, tool_choice="none")
    assert r.tools[0].name == "run_tests" and r.tool_choice == "none"
    assert [o.type for o in r.output] == ["message"]
    # the stored conversation holds the call and its output: a follow-up needs only its new message
    follow = create(stack, input="Summarise.", tools=tools, tool_choice="none", previous_response_id=r.id)
    assert follow.usage.input_tokens > r.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "hi", "previous_response_id": "resp_nothing"}, 404, "previous_response_id"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, 400, "tools[0].name"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"},
      "tools": [{"type": "function", "name": "f"}]}, 400, "tool_choice"),
    ({"input": "hi", "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 10**7}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, 400, "temperature"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "model": "gpt-nothing"}, 404, "model"),
])
def test_errors_name_the_param_and_publish_nothing(stack: ServingStack, no_jobs: None, body: dict,
                                                   status: int, param: str | None) -> None:
    r = httpx.post(f"{stack.base_url}/v1/responses", json={"model": stack.model_dir.name, **body},
                   headers={"authorization": "Bearer sk-resp-a"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_stored_response_survives_an_ingress_restart(stack: ServingStack) -> None:
    first = create(stack, input="Remember the number 7.", instructions=RULES)
    stack.procs.pop("ingress-0").stop(grace_s=3.0)
    stack.start_ready("ingress", "ingress-0")
    assert client(stack).responses.retrieve(first.id).output_text == first.output_text
    follow = create(stack, input="Which number?", instructions=RULES, previous_response_id=first.id)
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the workers kept the blocks
