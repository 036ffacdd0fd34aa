"""Which one constraint a request decodes under: forced calls, the answer's format, or nothing."""

from __future__ import annotations

import pytest
from kvmesh.ingress.core.errors import ApiError
from kvmesh.ingress.dialects.tool_choice import (
    ToolChoice,
    json_constraint,
    request_constraint,
)
from kvmesh.protocol.serving import ToolSchema
from kvmesh.toolcalls.formats import HERMES

TOOLS = [ToolSchema(name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}}),
         ToolSchema(name="ping")]
ANSWER = json_constraint({"type": "object", "properties": {"ok": {"type": "boolean"}}})


def test_forced_calls_win_over_the_answer_format() -> None:
    c = request_constraint(TOOLS, ToolChoice("required"), HERMES, True, ANSWER, "response_format")
    assert c is not None and c.kind == "tool_calls" and [t.name for t in c.tools] == ["get_weather", "ping"]
    named = request_constraint(TOOLS, ToolChoice("named", "ping"), HERMES, False, ANSWER, "response_format")
    assert named is not None and [t.name for t in named.tools] == ["ping"] and not named.parallel


def test_the_answer_format_is_forced_only_when_no_tool_may_be_called() -> None:
    assert request_constraint(TOOLS, ToolChoice("auto"), HERMES, True, ANSWER, "response_format") is None
    assert request_constraint(TOOLS, ToolChoice("none"), HERMES, True, ANSWER, "response_format") == ANSWER
    assert request_constraint([], ToolChoice("none"), HERMES, True, ANSWER, "response_format") == ANSWER
    assert request_constraint(TOOLS, ToolChoice("auto"), HERMES, True, None, "response_format") is None


def test_a_bad_answer_schema_is_a_400_naming_its_field() -> None:
    bad = json_constraint({"type": "object", "properties": {"x": {"type": "no-such-type"}}})
    with pytest.raises(ApiError) as err:
        request_constraint([], ToolChoice("none"), HERMES, True, bad, "text.format.schema")
    assert err.value.param == "text.format.schema"


def test_a_named_tool_that_is_not_offered_is_a_400() -> None:
    with pytest.raises(ApiError) as err:
        request_constraint(TOOLS, ToolChoice("named", "nope"), HERMES, True, None, "response_format")
    assert err.value.param == "tool_choice"
