"""A session's parent as the client names it: three sources, their precedence, the id rules."""

from __future__ import annotations

import pytest
from kvmesh.sessions.foreign_hints import foreign_hints
from kvmesh.sessions.identity import MAX_ID_CHARS, SessionInputError, hints
from kvmesh.sessions.lineage import ParentRef, ParentSource, named_parent

KVMESH_HEADER = {"x-kvmesh-parent-session-id": "lead-h"}
DYNAMO_HEADER = {"x-dynamo-parent-session-id": "lead-d"}
BODY = {"kvmesh": {"parent_session_id": "lead-b"}}


@pytest.mark.parametrize(("headers", "body", "expected"), [
    ({**KVMESH_HEADER, **DYNAMO_HEADER}, BODY, ParentRef("lead-h", ParentSource.HEADER)),
    (DYNAMO_HEADER, BODY, ParentRef("lead-b", ParentSource.BODY)),
    (DYNAMO_HEADER, {}, ParentRef("lead-d", ParentSource.DYNAMO_HEADER)),
    ({}, {"kvmesh": {"expected_return_ms": 5}}, None),
    ({}, {}, None),
])
def test_precedence_kvmesh_header_then_body_then_dynamo(headers: dict, body: dict, expected: ParentRef | None) -> None:
    assert named_parent(headers, body) == expected


def test_blank_counts_as_absent_and_values_are_trimmed() -> None:
    headers = {"x-kvmesh-parent-session-id": "  ", "x-dynamo-parent-session-id": " lead-d "}
    assert named_parent(headers, {"kvmesh": {"parent_session_id": ""}}) == ParentRef("lead-d",
                                                                                      ParentSource.DYNAMO_HEADER)


@pytest.mark.parametrize(("headers", "body", "param"), [
    ({"x-kvmesh-parent-session-id": "p" * (MAX_ID_CHARS + 1)}, {}, "x-kvmesh-parent-session-id"),
    ({"x-kvmesh-parent-session-id": "bad\x00id"}, {}, "x-kvmesh-parent-session-id"),
    ({}, {"kvmesh": {"parent_session_id": 42}}, "kvmesh.parent_session_id"),
    ({}, {"kvmesh": {"parent_session_id": "x" * 300}}, "kvmesh.parent_session_id"),
    ({"x-dynamo-parent-session-id": "bad\x07id"}, {}, "x-dynamo-parent-session-id"),
])
def test_a_malformed_chosen_parent_names_its_source(headers: dict, body: dict, param: str) -> None:
    with pytest.raises(SessionInputError) as err:
        named_parent(headers, body)
    assert err.value.param == param


def test_a_losing_kvmesh_value_is_not_checked_but_dynamos_header_always_is() -> None:
    """As with the other hints: kvmesh's own header wins unchecked over the body; a foreign header is
    checked whole whenever present (shared/sessions/foreign_hints.py)."""
    assert named_parent(KVMESH_HEADER, {"kvmesh": {"parent_session_id": 42}}) == ParentRef("lead-h",
                                                                                           ParentSource.HEADER)
    bad_dynamo = {**KVMESH_HEADER, "x-dynamo-parent-session-id": "p" * 300}
    assert named_parent(bad_dynamo, {}).client_id == "lead-h"
    with pytest.raises(SessionInputError) as err:
        foreign_hints(bad_dynamo, {})
    assert err.value.param == "x-dynamo-parent-session-id"


def test_the_body_extension_takes_the_parent_beside_the_other_hints() -> None:
    body = {"kvmesh": {"parent_session_id": "lead", "expected_return_ms": 1500}}
    assert hints({}, body).expected_return_ms == 1500  # a known field of the extension now
    with pytest.raises(SessionInputError) as err:
        hints({}, {"kvmesh": {"parent_session": "lead"}})
    assert err.value.param == "kvmesh.parent_session"
