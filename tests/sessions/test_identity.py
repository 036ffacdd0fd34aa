"""Session identity: explicit sources and their precedence, validation, tenant scoping, hints."""

from __future__ import annotations

import pytest
from kvmesh.sessions.identity import (
    MAX_ID_CHARS,
    SessionHints,
    SessionInputError,
    SessionRef,
    Source,
    explicit_anthropic,
    explicit_openai,
    hints,
    scoped_session_id,
)

ALL_OPENAI = {"metadata": {"session_id": "meta"}, "prompt_cache_key": "pck", "safety_identifier": "safe",
              "user": "usr"}


@pytest.mark.parametrize(("drop", "expected"), [
    ((), (Source.HEADER, "hdr")),
    (("header",), (Source.METADATA, "meta")),
    (("header", "metadata"), (Source.PROMPT_CACHE_KEY, "pck")),
    (("header", "metadata", "prompt_cache_key"), (Source.SAFETY_IDENTIFIER, "safe")),
    (("header", "metadata", "prompt_cache_key", "safety_identifier"), (Source.USER, "usr")),
    (("header", "metadata", "prompt_cache_key", "safety_identifier", "user"), None),
])
def test_openai_precedence(drop: tuple[str, ...], expected: tuple[Source, str] | None) -> None:
    headers = {} if "header" in drop else {"x-session-id": "hdr"}
    body = {k: v for k, v in ALL_OPENAI.items() if k not in drop}
    assert explicit_openai(headers, body) == expected


def test_anthropic_precedence_and_blank_values_count_as_absent() -> None:
    body = {"metadata": {"user_id": "u-1"}}
    assert explicit_anthropic({"x-session-id": "h-1"}, body) == (Source.HEADER, "h-1")
    assert explicit_anthropic({"x-session-id": "  "}, body) == (Source.ANTHROPIC_USER, "u-1")
    assert explicit_anthropic({}, {"metadata": {"user_id": ""}}) is None
    assert explicit_openai({}, {"prompt_cache_key": "", "user": " u "}) == (Source.USER, "u")


@pytest.mark.parametrize(("headers", "body", "param"), [
    ({"x-session-id": "x" * (MAX_ID_CHARS + 1)}, {}, "x-session-id"),
    ({}, {"prompt_cache_key": "bad\x00id"}, "prompt_cache_key"),
    ({}, {"metadata": {"session_id": 7}}, "metadata.session_id"),
    ({}, {"metadata": "not an object"}, "metadata"),
])
def test_a_malformed_chosen_id_names_its_field(headers: dict, body: dict, param: str) -> None:
    with pytest.raises(SessionInputError) as err:
        explicit_openai(headers, body)
    assert err.value.param == param


def test_only_the_chosen_source_is_validated() -> None:
    assert explicit_openai({"x-session-id": "ok"}, {"user": "u" * 1000}) == (Source.HEADER, "ok")


def test_ids_are_scoped_to_their_tenant() -> None:
    a, b = scoped_session_id("alpha", "conv-1"), scoped_session_id("beta", "conv-1")
    assert a != b and a == scoped_session_id("alpha", "conv-1")
    # length-prefixed parts: moving characters between tenant and id gives another session
    assert scoped_session_id("ab", "c") != scoped_session_id("a", "bc")
    ref = SessionRef("alpha", "conv-1", Source.HEADER)
    assert ref.session_id == a and ref.explicit and not SessionRef("alpha", "x", Source.INFERRED).explicit
    assert a.startswith("s-") and len(a) == 34


def test_hints_from_headers_win_over_the_body_extension() -> None:
    body = {"kvmesh": {"expected_return_ms": 900, "session_end": False}}
    assert hints({}, body) == SessionHints(900, False)
    got = hints({"x-kvmesh-expected-return-ms": "1500", "x-kvmesh-session-end": "true"}, body)
    assert got == SessionHints(1500, True)
    assert hints({}, {}) == SessionHints()


@pytest.mark.parametrize(("headers", "body", "param"), [
    ({"x-kvmesh-expected-return-ms": "soon"}, {}, "x-kvmesh-expected-return-ms"),
    ({"x-kvmesh-expected-return-ms": "-5"}, {}, "x-kvmesh-expected-return-ms"),
    ({}, {"kvmesh": {"expected_return_ms": 1.5}}, "kvmesh.expected_return_ms"),
    ({}, {"kvmesh": {"expected_return_ms": True}}, "kvmesh.expected_return_ms"),
    ({}, {"kvmesh": {"expected_return_ms": 10**12}}, "kvmesh.expected_return_ms"),
    ({"x-kvmesh-session-end": "maybe"}, {}, "x-kvmesh-session-end"),
    ({}, {"kvmesh": {"expected_return": 5}}, "kvmesh.expected_return"),
    ({}, {"kvmesh": [1]}, "kvmesh"),
])
def test_malformed_hints_are_rejected(headers: dict, body: dict, param: str) -> None:
    with pytest.raises(SessionInputError) as err:
        hints(headers, body)
    assert err.value.param == param
