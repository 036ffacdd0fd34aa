"""The Responses API's pieces without a stack: items -> messages, output items and their events, key scoping."""

from __future__ import annotations

import json

import pytest
from kvmesh.ingress.core.errors import ApiError
from kvmesh.ingress.dialects.responses.conversation import stored, to_messages
from kvmesh.ingress.dialects.responses.models import ResponsesRequest, items
from kvmesh.ingress.dialects.responses.output import EventWriter
from kvmesh.ingress.dialects.responses.store import ResponseStore, tenant_scope
from kvmesh.ingress.dialects.responses.stream import OutputBuilder
from kvmesh.ingress.dialects.responses.tools import StreamedCalls, WholeCalls
from kvmesh.toolcalls.formats import HERMES
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

EVENTS = TypeAdapter(ResponseStreamEvent)


def test_items_become_chat_template_messages() -> None:
    new = items([
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Run "},
                                                         {"type": "input_text", "text": "it."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "run", "arguments": '{"path": "a"}'},
        {"type": "function_call", "call_id": "c2", "name": "run", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c2", "output": "ok"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "fine"}]},
    ])
    msgs = to_messages("Rules.", [], new)
    assert msgs == [
        {"role": "system", "content": "Rules."},
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": "Running.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run", "arguments": {"path": "a"}}},
            {"id": "c2", "type": "function", "function": {"name": "run", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c2", "name": "run", "content": "ok"},
        {"role": "tool", "tool_call_id": "c1", "name": "run", "content": "fine"},
    ]


def test_stored_items_read_back_the_same_and_calls_may_answer_history() -> None:
    history = items([{"role": "user", "content": "hi"},
                     {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}])
    again = items([stored(i) for i in history], param="previous_response_id")
    assert again == history
    out = to_messages(None, again, items([{"type": "function_call_output", "call_id": "c1", "output": "1"}]))
    assert out[-1] == {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "1"}
    assert items("just text") == items([{"role": "user", "content": "just text"}])


@pytest.mark.parametrize(("raw", "param"), [
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[0].call_id"),
    ([{"role": "user", "content": "a"}, {"type": "reasoning", "summary": []}], "input[1].type"),
    ([{"role": "tool", "content": "a"}], "input[0].role"),
    (["text"], "input[0]"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0].type"),
    ([{"type": "function_call_output", "call_id": "c", "output": 3}], "input[0].output"),
])
def test_bad_items_name_their_place(raw: list, param: str) -> None:
    with pytest.raises(ApiError) as err:
        to_messages(None, [], items(raw))
    assert err.value.param == param


def test_tool_choice_and_tools_are_checked_by_name() -> None:
    def body(**kw: object) -> ResponsesRequest:
        return ResponsesRequest.model_validate({"model": "m", "input": "x", **kw})

    assert body().choice() == "auto" and body(tool_choice="required").choice() == "required"
    assert body(tool_choice={"type": "function", "name": "f"}).choice().name == "f"
    for bad in ("sometimes", {"type": "function"}, {"type": "web_search"}, 3):
        with pytest.raises(ApiError) as err:
            body(tool_choice=bad).choice()
        assert err.value.param == "tool_choice"
    with pytest.raises(ApiError) as err:
        body(tools=[{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]).function_tools()
    assert err.value.param == "tools"
    with pytest.raises(ApiError) as err:
        body(tools=[{"type": "file_search"}]).function_tools()
    assert err.value.param == "tools[0].type"


def _events(frames: list[bytes]) -> list:
    out = []
    for frame in frames:
        name, data = frame.decode().strip().split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        out.append(event)
    return out


def test_text_then_a_call_make_two_items_with_their_events_in_order() -> None:
    output: list[dict] = []
    out = OutputBuilder(output, EventWriter())
    split = StreamedCalls(HERMES, ["ping"])
    text = 'Let me check.\n<tool_call>\n{"name": "ping", "arguments": {"n": 1}}\n</tool_call>'
    for k in range(0, len(text), 5):  # five characters a step: openers and names split across deltas
        split.feed(text[k:k + 5], out)
    split.finish(out)
    out.finish("completed")
    events = _events(out.take())
    assert [o["type"] for o in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"].strip() == "Let me check."
    assert json.loads(output[1]["arguments"]) == {"n": 1} and output[1]["status"] == "completed"
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_whole_and_streamed_splitting_agree_on_a_clean_call() -> None:
    text = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    results = []
    for split in (StreamedCalls(HERMES, ["ping"]), WholeCalls(HERMES, ["ping"])):
        output: list[dict] = []
        out = OutputBuilder(output, EventWriter())
        split.feed(text, out)
        split.finish(out)
        out.finish("completed")
        results.append([(o["type"], o.get("name"), o.get("arguments")) for o in output])
    assert results[0] == results[1] == [("function_call", "ping", "{}")]


def test_whitespace_alone_is_still_one_message_and_a_cut_message_is_incomplete() -> None:
    output: list[dict] = []
    out = OutputBuilder(output, EventWriter())
    out.add_text("  ")
    out.finish("incomplete")
    assert output == [{"id": output[0]["id"], "type": "message", "role": "assistant", "status": "incomplete",
                       "content": [{"type": "output_text", "text": "  ", "annotations": [], "logprobs": []}]}]
    _events(out.take())


def test_keys_are_scoped_by_tenant() -> None:
    assert tenant_scope("a") != tenant_scope("b") and tenant_scope("a") == tenant_scope("a")
    assert ResponseStore._key("a", "resp_1") != ResponseStore._key("b", "resp_1")
    assert ResponseStore._key("a", "resp.*") is None  # not a token: no such response, never a wildcard
