"""vLLM's and Dynamo's hint formats through a real stack, sent the way their users send them: the official
SDKs' `extra_body` / `extra_headers`. An accepted hint shows in the turn's SessionEvent and the response's
session header; a malformed one is a 400 in the route's own error format, and nothing is published.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from kvmesh.sessions.events import TurnOutcome
from kvmesh.sessions.identity import scoped_session_id
from kvmesh.stack.servers import S3Server

from ingress.serving_stack import ServingStack, job_count, one_of_each
from ingress.test_sessions import ant, chat, event_where, oai, session_seq, unique

KEYS = {"sk-foreign": "foreign"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("foreign-hints-stack"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


def kv_hints(value: int | None, ttl_seconds: float | None) -> dict[str, Any]:
    """A vLLM KV hints envelope with one `vllm.set_priority` claim on the request's cached blocks."""
    payload: dict[str, Any] = {"target": "request_cached", "location": "local_g1", "claim_id": "agent/run-1",
                               "revision": 1, "value": value}
    if ttl_seconds is not None:
        payload["ttl_seconds"] = ttl_seconds
    return {"protocol_version": "0.1", "message_id": unique("msg"),
            "actions": [{"action_id": "keep-prefix", "action_type": "vllm.set_priority", "action_version": "1.0",
                         "payload": payload}]}


def turn_of(stack: ServingStack, session: str):  # type: ignore[no-untyped-def]
    scoped = scoped_session_id("foreign", session)
    return event_where(stack, lambda e: e.session_id == scoped)


def test_openai_sdk_sends_vllm_and_dynamo_hints(stack: ServingStack) -> None:
    sid = unique("dyn")
    headers, _ = chat(stack, [{"role": "user", "content": unique("plan the work")}], key="sk-foreign",
                      extra_headers={"x-dynamo-session-id": sid, "x-dynamo-parent-session-id": "orchestrator-1"},
                      extra_body={"kv_hints": kv_hints(10, 45), "nvext": {"agent_hints": {"priority": 5, "osl": 64}}})
    assert headers["x-session-id"] == sid  # Dynamo's session header named the session
    ev = turn_of(stack, sid)
    assert ev.expected_return_ms == 45_000 and ev.outcome is TurnOutcome.ANSWER and ev.tenant == "foreign"
    assert ev.parent_session_id == scoped_session_id("foreign", "orchestrator-1")  # Dynamo's subagent parent

    # Dynamo's final marker ends the session; kvmesh's own return hint wins over the vLLM claim
    end = unique("dyn-end")
    chat(stack, [{"role": "user", "content": unique("wrap up")}], key="sk-foreign",
         extra_headers={"x-dynamo-session-id": end, "x-dynamo-session-final": "true",
                        "x-kvmesh-expected-return-ms": "1500"},
         extra_body={"kv_hints": kv_hints(10, 45)})
    ev = turn_of(stack, end)
    assert ev.outcome is TurnOutcome.ENDED and ev.expected_return_ms == 1500


def test_completions_responses_and_anthropic_take_them_too(stack: ServingStack) -> None:
    c = oai(stack, "sk-foreign")
    sids = [unique("cmpl"), unique("resp"), unique("msgs")]
    c.completions.create(model=stack.model_dir.name, prompt=unique("count to three"), max_tokens=3, temperature=0,
                         extra_headers={"x-dynamo-session-id": sids[0]}, extra_body={"kv_hints": kv_hints(1, 2)})
    c.responses.create(model=stack.model_dir.name, input=unique("say hi"), max_output_tokens=4,
                       extra_headers={"x-dynamo-session-id": sids[1]}, extra_body={"kv_hints": kv_hints(1, 3)})
    ant(stack, "sk-foreign").messages.create(
        model=stack.model_dir.name, max_tokens=3, messages=[{"role": "user", "content": unique("hello")}],
        extra_headers={"x-dynamo-session-id": sids[2], "x-dynamo-session-final": "on"},
        extra_body={"temperature": 0, "kv_hints": kv_hints(1, 4), "nvext": {"agent_hints": {"priority": 1}}})
    got = [turn_of(stack, sid) for sid in sids]
    assert [e.expected_return_ms for e in got] == [2_000, 3_000, 4_000]
    assert [e.outcome is TurnOutcome.ENDED for e in got] == [False, False, True]


def test_malformed_foreign_hints_are_400s_in_the_dialects_format_and_publish_nothing(stack: ServingStack) -> None:
    jobs, events = asyncio.run(job_count(stack.nats.url)), session_seq(stack)
    msgs = [{"role": "user", "content": unique("hello")}]
    bad: list[tuple[dict[str, Any], dict[str, str], str]] = [
        ({"kv_hints": "keep it"}, {}, "kv_hints"),  # the envelope is not an object
        ({"kv_hints": kv_hints(10, -1)}, {}, "kv_hints.actions[0].payload.ttl_seconds"),  # out of range
        ({"nvext": {"agent_hints": {"priority": "high"}}}, {}, "nvext.agent_hints.priority"),  # wrong type
        ({}, {"x-dynamo-session-final": "perhaps"}, "x-dynamo-session-final"),
    ]
    for body, headers, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            chat(stack, msgs, key="sk-foreign", extra_body=body, extra_headers=headers)
        assert err.value.status_code == 400
        assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    envelope = kv_hints(10, 60)
    envelope["actions"][0]["payload"]["target"] = "all_cached"  # not a value vLLM defines
    with pytest.raises(openai.BadRequestError) as err:
        oai(stack, "sk-foreign").responses.create(model=stack.model_dir.name, input="hi", max_output_tokens=4,
                                                   extra_body={"kv_hints": envelope})
    assert err.value.body["param"] == "kv_hints.actions[0].payload.target"

    with pytest.raises(anthropic.BadRequestError) as aerr:
        ant(stack, "sk-foreign").messages.create(model=stack.model_dir.name, max_tokens=3, messages=msgs,
                                                 extra_body={"nvext": {"agent_hints": {"osl": -1}}})
    assert aerr.value.status_code == 400 and aerr.value.body["type"] == "error"
    assert aerr.value.body["error"]["type"] == "invalid_request_error"
    assert "nvext.agent_hints.osl" in aerr.value.body["error"]["message"]
    assert asyncio.run(job_count(stack.nats.url)) == jobs and session_seq(stack) == events
