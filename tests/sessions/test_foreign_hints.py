"""Hints in vLLM's and Dynamo's formats: what each maps to, what is refused, and the precedence rule.

The parser is checked on any JSON value too: it returns hints or raises `SessionInputError`, never
anything else, so a request can only end in a hint or in a 400 naming the field.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.ingress.core.errors import ApiError, Dialect
from kvmesh.ingress.sessions.turn import inputs
from kvmesh.sessions.foreign_hints import check_nvext, dynamo_session_end, foreign_hints, vllm_return_ms
from kvmesh.sessions.identity import (
    MAX_RETURN_MS,
    SessionHints,
    SessionInputError,
    Source,
    explicit_anthropic,
    explicit_openai,
    hints,
)

def claim(value: int | None = 10, ttl: float | None = 60.0, **extra: Any) -> dict[str, Any]:
    payload = {"target": "request_cached", "location": "local_g1", "claim_id": "router/s-1", "revision": 1,
               "value": value, **extra}
    if ttl is not None:
        payload["ttl_seconds"] = ttl
    return payload


def envelope(*payloads: dict[str, Any], kind: str = "vllm.set_priority", version: str = "1.0",
             protocol: str = "0.1") -> dict[str, Any]:
    return {"protocol_version": protocol, "message_id": "router/m-1",
            "actions": [{"action_id": f"a{i}", "action_type": kind, "action_version": version, "payload": p}
                        for i, p in enumerate(payloads)]}


# --- vLLM kv_hints -----------------------------------------------------------------------------------

def test_a_positive_priority_claim_is_an_expected_return_within_its_ttl() -> None:
    assert vllm_return_ms(envelope(claim(10, 60))) == 60_000
    assert vllm_return_ms(envelope(claim(1, 0.25))) == 250
    # several claims: the blocks stay above the default until the longest positive one lapses
    assert vllm_return_ms(envelope(claim(5, 30), claim(50, 90), claim(-3, 600))) == 90_000
    # kvmesh's horizon is a week: a longer TTL says no more than that
    assert vllm_return_ms(envelope(claim(10, 30 * 86_400))) == MAX_RETURN_MS
    assert vllm_return_ms(envelope(claim(10, 10**20))) == MAX_RETURN_MS


def test_claims_that_keep_nothing_and_actions_kvmesh_does_not_read_imply_no_return() -> None:
    assert vllm_return_ms(None) is None
    assert vllm_return_ms(envelope()) is None  # an envelope with no actions
    assert vllm_return_ms(envelope(claim(0, 60))) is None  # the default priority
    assert vllm_return_ms(envelope(claim(-5, 60))) is None  # evict sooner
    assert vllm_return_ms(envelope(claim(None, None))) is None  # clears a claim
    # another system's action, a later action version, a later protocol: left alone, as vLLM does
    assert vllm_return_ms(envelope({"source_control_endpoint": "tcp://h:1", "block_hashes": [1]},
                                   kind="kv.fetch")) is None
    assert vllm_return_ms(envelope({"anything": True}, version="2.0")) is None
    assert vllm_return_ms(envelope({"anything": True}, protocol="0.2")) is None
    # extra envelope and action fields are tolerated (the format preserves them)
    env = envelope(claim(3, 5))
    env["trace"] = {"x": 1}
    env["actions"][0]["note"] = "kept"
    assert vllm_return_ms(env) == 5_000


def _with(env: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    node = env
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return env


@pytest.mark.parametrize(("path", "value", "param"), [
    ((), "not an object", "kv_hints"),
    (("protocol_version",), 0.1, "kv_hints.protocol_version"),
    (("message_id",), None, "kv_hints.message_id"),
    (("actions",), {"a": 1}, "kv_hints.actions"),
    (("actions", 0), "retain", "kv_hints.actions[0]"),
    (("actions", 0, "action_type"), 7, "kv_hints.actions[0].action_type"),
    (("actions", 0, "payload"), [1], "kv_hints.actions[0].payload"),
    (("actions", 0, "payload", "target"), "all_cached", "kv_hints.actions[0].payload.target"),
    (("actions", 0, "payload", "location"), "remote", "kv_hints.actions[0].payload.location"),
    (("actions", 0, "payload", "claim_id"), "", "kv_hints.actions[0].payload.claim_id"),
    (("actions", 0, "payload", "claim_id"), "c" * 257, "kv_hints.actions[0].payload.claim_id"),
    (("actions", 0, "payload", "revision"), -1, "kv_hints.actions[0].payload.revision"),
    (("actions", 0, "payload", "revision"), True, "kv_hints.actions[0].payload.revision"),
    (("actions", 0, "payload", "value"), 2**63, "kv_hints.actions[0].payload.value"),
    (("actions", 0, "payload", "value"), "high", "kv_hints.actions[0].payload.value"),
    (("actions", 0, "payload", "ttl_seconds"), 0, "kv_hints.actions[0].payload.ttl_seconds"),
    (("actions", 0, "payload", "ttl_seconds"), math.inf, "kv_hints.actions[0].payload.ttl_seconds"),
    (("actions", 0, "payload", "ttl_seconds"), math.nan, "kv_hints.actions[0].payload.ttl_seconds"),
    (("actions", 0, "payload", "ttl_seconds"), None, "kv_hints.actions[0].payload.ttl_seconds"),
    (("actions", 0, "payload", "ttl_seconds"), 10**400, "kv_hints.actions[0].payload.ttl_seconds"),
    (("actions", 0, "payload", "scope"), "x", "kv_hints.actions[0].payload.scope"),
])
def test_a_malformed_envelope_names_its_field(path: tuple[Any, ...], value: Any, param: str) -> None:
    env: Any = value if not path else _with(envelope(claim()), path, value)
    with pytest.raises(SessionInputError) as err:
        vllm_return_ms(env)
    assert err.value.param == param


def test_set_priority_needs_a_value_and_clearing_takes_no_ttl() -> None:
    no_value = claim()
    del no_value["value"]
    with pytest.raises(SessionInputError, match="value"):
        vllm_return_ms(envelope(no_value))
    with pytest.raises(SessionInputError, match="clearing"):
        vllm_return_ms(envelope(claim(None, 30)))


def test_another_protocols_payloads_are_not_checked_but_its_shape_is() -> None:
    assert vllm_return_ms(envelope({"target": "whatever"}, protocol="0.2")) is None
    with pytest.raises(SessionInputError):
        vllm_return_ms({"protocol_version": "0.2", "message_id": "m", "actions": [{"payload": {}}]})


# --- Dynamo agent hints and session headers -------------------------------------------------------------

def test_agent_hints_are_checked_and_other_nvext_fields_left_to_dynamo() -> None:
    full = {"priority": -5, "strict_priority": 2, "osl": 1024, "speculative_prefill": True,
            "latency_sensitivity": 1.2}
    check_nvext({"agent_hints": full, "greed_sampling": True, "extra_fields": ["timing"]})
    check_nvext({"agent_hints": None})
    check_nvext({"agent_hints": {"priority": None}})
    check_nvext(None)
    # they carry no return time or end: the hints are kvmesh's defaults
    assert foreign_hints({}, {"nvext": {"agent_hints": full}}) == SessionHints()


@pytest.mark.parametrize(("nvext", "param"), [
    ("fast", "nvext"),
    ({"agent_hints": [1]}, "nvext.agent_hints"),
    ({"agent_hints": {"expected_return_ms": 5}}, "nvext.agent_hints.expected_return_ms"),
    ({"agent_hints": {"priority": 2**31}}, "nvext.agent_hints.priority"),
    ({"agent_hints": {"priority": 1.5}}, "nvext.agent_hints.priority"),
    ({"agent_hints": {"strict_priority": -1}}, "nvext.agent_hints.strict_priority"),
    ({"agent_hints": {"osl": "1024"}}, "nvext.agent_hints.osl"),
    ({"agent_hints": {"speculative_prefill": "yes"}}, "nvext.agent_hints.speculative_prefill"),
    ({"agent_hints": {"latency_sensitivity": False}}, "nvext.agent_hints.latency_sensitivity"),
    ({"agent_hints": {"latency_sensitivity": math.nan}}, "nvext.agent_hints.latency_sensitivity"),
])
def test_malformed_agent_hints_name_their_field(nvext: Any, param: str) -> None:
    with pytest.raises(SessionInputError) as err:
        check_nvext(nvext)
    assert err.value.param == param


def test_session_final_header_ends_the_session() -> None:
    for text in ("true", "TRUE", " 1 ", "yes", "on"):
        assert dynamo_session_end({"x-dynamo-session-final": text})
    for text in ("false", "0", "no", "off", "", "   "):
        assert not dynamo_session_end({"x-dynamo-session-final": text})
    assert not dynamo_session_end({})
    ok = {"x-dynamo-parent-session-id": "planner-1", "x-dynamo-request-priority": "-3",
          "x-dynamo-request-strict-priority": "+7"}
    assert not dynamo_session_end(ok)


@pytest.mark.parametrize(("headers", "param"), [
    ({"x-dynamo-session-final": "maybe"}, "x-dynamo-session-final"),
    ({"x-dynamo-parent-session-id": "p" * 257}, "x-dynamo-parent-session-id"),
    ({"x-dynamo-parent-session-id": "bad\x00id"}, "x-dynamo-parent-session-id"),
    ({"x-dynamo-request-priority": "high"}, "x-dynamo-request-priority"),
    ({"x-dynamo-request-priority": "1_000"}, "x-dynamo-request-priority"),
    ({"x-dynamo-request-priority": "9" * 5000}, "x-dynamo-request-priority"),
    ({"x-dynamo-request-strict-priority": "-1"}, "x-dynamo-request-strict-priority"),
])
def test_malformed_dynamo_headers_name_themselves(headers: dict[str, str], param: str) -> None:
    with pytest.raises(SessionInputError) as err:
        dynamo_session_end(headers)
    assert err.value.param == param


def test_the_dynamo_session_header_names_the_session_after_x_session_id() -> None:
    body = {"metadata": {"session_id": "meta"}, "prompt_cache_key": "pck"}
    assert explicit_openai({"x-dynamo-session-id": "dyn"}, body) == (Source.DYNAMO_HEADER, "dyn")
    assert explicit_openai({"x-session-id": "own", "x-dynamo-session-id": "dyn"}, body) == (Source.HEADER, "own")
    assert explicit_openai({"x-dynamo-session-id": "  "}, body) == (Source.METADATA, "meta")
    anthropic = {"metadata": {"user_id": "u"}}
    assert explicit_anthropic({"x-dynamo-session-id": "dyn"}, anthropic) == (Source.DYNAMO_HEADER, "dyn")
    # it is validated like any chosen id, and not when it loses
    with pytest.raises(SessionInputError) as err:
        explicit_openai({"x-dynamo-session-id": "d" * 300}, {})
    assert err.value.param == "x-dynamo-session-id"
    assert explicit_openai({"x-session-id": "own", "x-dynamo-session-id": "d" * 300}, {}) == (Source.HEADER, "own")


# --- precedence: kvmesh's own hints first, then the foreign formats -----------------------------------

def _merged(headers: dict[str, str], body: dict[str, Any]) -> SessionHints:
    return hints(headers, body, foreign_hints(headers, body))


def test_kvmesh_hints_win_over_foreign_ones_field_by_field() -> None:
    foreign = {"kv_hints": envelope(claim(10, 60))}
    final = {"x-dynamo-session-final": "true"}
    assert _merged(final, foreign) == SessionHints(60_000, True)  # foreign alone
    assert _merged({**final, "x-kvmesh-expected-return-ms": "1500"}, foreign) == SessionHints(1500, True)
    assert _merged(final, {**foreign, "kvmesh": {"expected_return_ms": 800}}) == SessionHints(800, True)
    # an explicit kvmesh "not the end" wins over Dynamo's final marker, header or body
    assert _merged({**final, "x-kvmesh-session-end": "false"}, foreign) == SessionHints(60_000, False)
    assert _merged(final, {**foreign, "kvmesh": {"session_end": False}}) == SessionHints(60_000, False)
    assert _merged({}, {}) == SessionHints()


def test_a_malformed_foreign_hint_is_refused_even_where_a_kvmesh_hint_wins() -> None:
    with pytest.raises(SessionInputError) as err:
        _merged({"x-kvmesh-expected-return-ms": "1500"}, {"kv_hints": envelope(claim(10, -1))})
    assert err.value.param == "kv_hints.actions[0].payload.ttl_seconds"


class _Request:
    """What `inputs` reads of an admitted request."""

    def __init__(self, headers: dict[str, str], body: dict[str, Any]) -> None:
        self.headers, self.body, self.principal, self.request_id, self.path = headers, body, None, "req_1", "/"


def test_inputs_turns_a_malformed_foreign_hint_into_a_400_in_either_dialect() -> None:
    for dialect in Dialect:
        with pytest.raises(ApiError) as err:
            inputs(_Request({}, {"nvext": {"agent_hints": {"osl": -1}}}), dialect)  # type: ignore[arg-type]
        assert err.value.param == "nvext.agent_hints.osl" and err.value.status(dialect) == 400
    got = inputs(_Request({"x-dynamo-session-id": "dyn", "x-dynamo-session-final": "1"},  # type: ignore[arg-type]
                          {"kv_hints": envelope(claim(1, 2))}), Dialect.ANTHROPIC)
    assert got.explicit == (Source.DYNAMO_HEADER, "dyn") and got.hints == SessionHints(2_000, True)


# --- any JSON value: hints or the one error ----------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4),
                    max_leaves=12)


def _mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` nine times in ten, else any JSON value: deep checks are reached, and each can fail."""
    return st.integers(0, 9).flatmap(lambda n: valid if n else JSON)


def _payloads() -> st.SearchStrategy[Any]:
    """set_priority payloads near the valid ones."""
    return _mostly(st.fixed_dictionaries({
        "target": _mostly(st.just("request_cached")), "location": _mostly(st.just("local_g1")),
        "claim_id": _mostly(st.text(max_size=300)), "revision": _mostly(st.integers(-2, 2**64)),
        "value": _mostly(st.integers(-(2**64), 2**64) | st.none()),
    }, optional={"ttl_seconds": st.floats(0.001, 1e9) | st.floats() | st.integers(-5, 10**400)}))


def _envelopes() -> st.SearchStrategy[Any]:
    action = st.fixed_dictionaries({
        "action_id": _mostly(st.text(max_size=4)), "action_type": _mostly(st.just("vllm.set_priority")),
        "action_version": _mostly(st.just("1.0")), "payload": _payloads()})
    return _mostly(st.fixed_dictionaries({
        "protocol_version": _mostly(st.just("0.1")), "message_id": _mostly(st.text(max_size=4)),
        "actions": _mostly(st.lists(_mostly(action), max_size=3))}))


def _agent_hints() -> st.SearchStrategy[Any]:
    value = st.integers(-(2**40), 2**40) | st.floats() | st.booleans() | JSON
    hint = st.dictionaries(st.sampled_from(["priority", "strict_priority", "osl", "speculative_prefill",
                                            "latency_sensitivity", "x"]), value, max_size=3)
    return _mostly(st.dictionaries(st.sampled_from(["agent_hints", "greed_sampling"]), _mostly(hint), max_size=2))


HEADER_TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=40)


@settings(max_examples=400, deadline=None)
@given(kv_hints=_envelopes(), nvext=_agent_hints(),
       headers=st.dictionaries(st.sampled_from(["x-dynamo-session-final", "x-dynamo-parent-session-id",
                                                 "x-dynamo-request-priority",
                                                 "x-dynamo-request-strict-priority"]), HEADER_TEXT))
def test_any_input_parses_to_valid_hints_or_the_one_error(kv_hints: Any, nvext: Any, headers: dict[str, str]
                                                           ) -> None:
    try:
        got = foreign_hints(headers, {"kv_hints": kv_hints, "nvext": nvext})
    except SessionInputError as err:
        assert err.param and err.message
        return
    assert isinstance(got.session_end, bool)
    ret = got.expected_return_ms
    assert ret is None or (isinstance(ret, int) and not isinstance(ret, bool) and 0 < ret <= MAX_RETURN_MS)
