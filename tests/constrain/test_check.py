"""check.validate: the ingress's 400 for constraints no grammar can be built from, without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvmesh.constrain.check import ConstraintError, validate
from kvmesh.protocol.serving import Constraint, ToolSchema

WEATHER = ToolSchema(name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]})


@pytest.mark.parametrize("constraint", [
    Constraint(kind="json"),
    Constraint(kind="json", json_schema={"type": "object", "properties": {"a": {"enum": [1, "x", None]}}}),
    Constraint(kind="json", json_schema={"type": "array", "items": {"$ref": "#/$defs/p"},
                                         "$defs": {"p": {"type": "number", "minimum": 0}}}),
    Constraint(kind="tool_calls", tools=[WEATHER], tool_format="hermes"),
    Constraint(kind="tool_calls", tools=[WEATHER, ToolSchema(name="noop")], tool_format="llama3_json", parallel=False),
])
def test_accepts_compilable_constraints(constraint: Constraint) -> None:
    validate(constraint)


@pytest.mark.parametrize(("constraint", "reason"), [
    (Constraint(kind="json", json_schema={"type": "foo"}), "Invalid type"),
    (Constraint(kind="json", json_schema={"type": "string", "minLength": "x"}), "minLength"),
    (Constraint(kind="json", json_schema={"type": "object", "propertyNames": {"maxLength": 3}}), "propertyNames"),
    (Constraint(kind="json", json_schema={"$ref": "#/nowhere"}), "nowhere"),
    (Constraint(kind="tool_calls", tools=[], tool_format="hermes"), "no tools"),
    (Constraint(kind="tool_calls", tools=[WEATHER], tool_format="xml"), "unknown tool-call format"),
    (Constraint(kind="tool_calls", tools=[WEATHER, WEATHER], tool_format="hermes"), "duplicate"),
    (Constraint(kind="tool_calls", tool_format="hermes",
                tools=[ToolSchema(name="f", parameters={"type": "object", "properties": {"x": {"type": "nope"}}})]),
     "Invalid type"),
])
def test_rejects_with_a_one_line_reason(constraint: Constraint, reason: str) -> None:
    with pytest.raises(ConstraintError, match=reason) as info:
        validate(constraint)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


def test_check_does_not_import_torch() -> None:
    code = ("import sys; from kvmesh.constrain.check import validate; from kvmesh.protocol.serving import Constraint; "
            "validate(Constraint(kind='json')); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
