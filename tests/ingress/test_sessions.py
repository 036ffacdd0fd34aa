"""Agent sessions at the ingress, end to end on a real stack with the official SDKs.

Every request gets a session (explicit, inferred from its chain, or new;
scoped to its tenant); every finished turn publishes a SessionEvent on
stream SESSIONS with its outcome, chain and hints; the end endpoint and the
end hint publish `ended`; malformed ids and hints are 400s in the dialect's
format with nothing published. The inference table is also checked on its own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import httpx
import nats
import openai
import pytest
from kvmesh.bus.publish import PublishError
from kvmesh.config import EngineSettings
from kvmesh.ingress.admission.admit import Admitted
from kvmesh.ingress.admission.auth import Principal
from kvmesh.ingress.core.metrics import IngressMetrics
from kvmesh.ingress.sessions.table import SessionTable, anchor_of
from kvmesh.ingress.sessions.tracker import ChainHasher, SessionTracker
from kvmesh.ingress.sessions.turn import SessionInputs
from kvmesh.kv_events.events import BlockStored, KVEventBatch
from kvmesh.protocol import subjects
from kvmesh.protocol.block_hash import HashKeys, hash_blocks
from kvmesh.sessions.events import SessionEvent, TurnOutcome
from kvmesh.sessions.identity import SessionHints, SessionRef, Source, scoped_session_id
from kvmesh.sessions.outcome import ToolEvidence
from kvmesh.stack.servers import S3Server
from nats.js import api
from prometheus_client import CollectorRegistry

from ingress.serving_stack import ServingStack, job_count, one_of_each

KEYS = {"sk-sess-a": "sess-a", "sk-sess-b": "sess-b"}
BLOCK = EngineSettings().block_size
TOOLS = [{"type": "function", "function": {"name": "list_files", "description": "List files.",
                                            "parameters": {"type": "object", "properties": {}}}}]


# --- the inference table alone -------------------------------------------------

def _hashes(ids: list[int], salt: bytes = b"t") -> list[bytes]:
    return list(hash_blocks(ids, BLOCK, HashKeys("m", salt)))


def test_table_continues_the_session_whose_last_turn_is_a_prefix() -> None:
    table = SessionTable(BLOCK, capacity=2)
    system = list(range(100, 100 + BLOCK))  # one full block every conversation shares
    first = system + [1, 2, 3]
    rec = table.record(SessionRef("t", "auto-1", Source.NEW))
    table.turn_ended(rec, [anchor_of(first, _hashes(first), BLOCK)])

    nxt = first + [9] * (2 * BLOCK)
    assert table.find("t", nxt, _hashes(nxt)) is rec
    other = system + [1, 2, 4] + [9] * BLOCK  # shares the system block, not the turn: a new session
    assert table.find("t", other, _hashes(other)) is None
    assert table.find("u", nxt, _hashes(nxt)) is None  # another tenant never matches

    # a later turn replaces the anchors: a request branching from the first turn starts anew
    table.turn_ended(rec, [anchor_of(nxt, _hashes(nxt), BLOCK)])
    branch = first + [7] * BLOCK
    assert table.find("t", branch, _hashes(branch)) is None
    assert table.find("t", nxt + [5], _hashes(nxt + [5])) is rec

    # bounded: the least recently active session and its anchors go first
    for n in (2, 3):
        table.record(SessionRef("t", f"auto-{n}", Source.NEW))
    assert len(table) == 2 and table.find("t", nxt, _hashes(nxt)) is None


def test_table_prefers_the_deepest_anchor_and_forgets_ended_sessions() -> None:
    table = SessionTable(BLOCK)
    short = [5] * (BLOCK + 2)
    deep = short + [6] * (2 * BLOCK)
    a, b = (table.record(SessionRef("t", c, Source.NEW)) for c in ("a", "b"))
    table.turn_ended(a, [anchor_of(short, _hashes(short), BLOCK)])
    table.turn_ended(b, [anchor_of(deep, _hashes(deep), BLOCK)])
    req = deep + [1]
    assert table.find("t", req, _hashes(req)) is b
    table.end("t", "b")
    assert table.find("t", req, _hashes(req)) is a


class _DownBus:
    """A publisher whose bus never takes anything."""

    async def publish(self, subject: str, payload: object, msg_id: str, **kw: object) -> None:
        raise PublishError(f"bus down ({msg_id})")


async def test_tracker_counts_a_lost_event_and_still_remembers_the_turn() -> None:
    registry = CollectorRegistry()
    tracker = SessionTracker(SessionTable(BLOCK), ChainHasher(BLOCK), IngressMetrics.create(registry),
                             _DownBus())  # type: ignore[arg-type]
    principal, given = Principal("k", "t", "00"), SessionInputs(None, SessionHints())

    def admitted(request_id: str) -> Admitted:
        return Admitted(None, principal, {}, request_id, None)  # type: ignore[arg-type]

    prompt = list(range(100, 100 + 2 * BLOCK + 3))
    first = tracker.begin(admitted("req_1"), given, prompt, ToolEvidence())
    tracker.announce(first)
    assert first.ref.source is Source.NEW and first.ref.client_id == "auto-1"
    tracker.finish(first, [7, 8, 9, 2], [7, 8, 9], "stop", "decode-0")  # does not raise
    await tracker.drain(10.0)
    # both of the turn's events were lost: its start and its end
    assert registry.get_sample_value("kvmesh_ingress_session_event_failures_total") == 2
    # the next turn's prompt holds the answer's ids: it continues the session
    nxt = tracker.begin(admitted("req_2"), given, [*prompt, 7, 8, 9, 2, 40, 41], ToolEvidence())
    assert (nxt.ref.client_id, nxt.ref.source) == ("auto-1", Source.INFERRED)
    assert registry.get_sample_value("kvmesh_ingress_sessions_total", {"source": "inferred"}) == 1


# --- the stack ---------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("sessions-stack"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


def oai(stack: ServingStack, key: str = "sk-sess-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def ant(stack: ServingStack, key: str = "sk-sess-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key=key, max_retries=0, timeout=60)


def unique(text: str) -> str:
    return f"[{uuid.uuid4().hex}] {text}"


def rid(response_id: str) -> str:
    """The ingress request id behind a chatcmpl-/msg_ response id."""
    return "req_" + response_id.split("-", 1)[-1].removeprefix("msg_")


async def _wait(url: str, stream: str, subject: str, match: Callable[[bytes], bool], timeout_s: float) -> bytes:
    """The first message of `stream` on `subject` (from the start) that `match`es; TimeoutError if none comes."""
    nc = await nats.connect(url)
    try:
        sub = await nc.jetstream().pull_subscribe(subject, stream=stream, config=api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.ALL, ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0))
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while loop.time() < end:
            try:
                msgs = await sub.fetch(100, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                if match(msg.data):
                    return msg.data
        raise TimeoutError(f"no matching message on {subject} within {timeout_s}s")
    finally:
        await nc.close()


def event_where(stack: ServingStack, pred: Callable[[SessionEvent], bool], timeout_s: float = 30.0) -> SessionEvent:
    """The first turn-end event that matches (a turn's `started` event shares its request id)."""
    data = asyncio.run(_wait(stack.nats.url, "SESSIONS", subjects.SESSION_EVENTS,
                             lambda d: _ends(e := SessionEvent.from_bytes(d)) and pred(e), timeout_s))
    return SessionEvent.from_bytes(data)


def _ends(ev: SessionEvent) -> bool:
    return ev.outcome is not TurnOutcome.STARTED


def events_where(stack: ServingStack, pred: Callable[[SessionEvent], bool]) -> list[SessionEvent]:
    """Every turn-end event so far that matches (call it after waiting for a later event: nothing is in flight)."""
    async def scan() -> list[SessionEvent]:
        nc = await nats.connect(stack.nats.url)
        try:
            sub = await nc.jetstream().pull_subscribe(subjects.SESSION_EVENTS, stream="SESSIONS",
                                                      config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE))
            info = await nc.jetstream().stream_info("SESSIONS")
            out: list[SessionEvent] = []
            seen = 0
            while seen < info.state.messages:
                msgs = await sub.fetch(500, timeout=5.0)
                seen += len(msgs)
                out += [e for m in msgs if _ends(e := SessionEvent.from_bytes(m.data)) and pred(e)]
            return out
        finally:
            await nc.close()

    return asyncio.run(scan())


def session_seq(stack: ServingStack) -> int:
    async def last() -> int:
        nc = await nats.connect(stack.nats.url)
        try:
            return int((await nc.jetstream().stream_info("SESSIONS")).state.last_seq)
        finally:
            await nc.close()

    return asyncio.run(last())


def chat(stack: ServingStack, messages: list[dict], key: str = "sk-sess-a",  # type: ignore[no-untyped-def]
         **kw: object):
    raw = oai(stack, key).chat.completions.with_raw_response.create(
        model=stack.model_dir.name, messages=messages, **{"max_tokens": 3, "temperature": 0, **kw})
    return raw.headers, raw.parse()


def test_explicit_sources_and_precedence_openai(stack: ServingStack) -> None:
    msgs = [{"role": "user", "content": unique("hello")}]
    cases = [({"extra_headers": {"x-session-id": "hdr-1"}, "prompt_cache_key": "pck-1", "user": "u-1"}, "hdr-1"),
             ({"metadata": {"session_id": "meta-1"}, "prompt_cache_key": "pck-1"}, "meta-1"),
             ({"prompt_cache_key": "pck-1", "safety_identifier": "safe-1", "user": "u-1"}, "pck-1"),
             ({"safety_identifier": "safe-1", "user": "u-1"}, "safe-1"),
             ({"user": "u-1"}, "u-1")]
    for kw, expected in cases:
        headers, r = chat(stack, msgs, **kw)
        assert headers["x-session-id"] == expected
        ev = event_where(stack, lambda e, want=rid(r.id): e.request_id == want)
        assert ev.session_id == scoped_session_id("sess-a", expected) and ev.tenant == "sess-a"


def test_explicit_sources_anthropic_and_tenant_scoping(stack: ServingStack) -> None:
    args = {"model": stack.model_dir.name, "max_tokens": 3, "messages": [{"role": "user", "content": unique("hi")}],
            "metadata": {"user_id": "anth-user"}}
    raw = ant(stack).messages.with_raw_response.create(**args, extra_body={"temperature": 0})
    assert raw.headers["x-session-id"] == "anth-user"
    raw = ant(stack).messages.with_raw_response.create(**args, extra_headers={"x-session-id": "shared-id"})
    assert raw.headers["x-session-id"] == "shared-id"
    a = event_where(stack, lambda e, want=rid(raw.parse().id): e.request_id == want)
    _, r = chat(stack, [{"role": "user", "content": unique("hi")}], key="sk-sess-b",
                extra_headers={"x-session-id": "shared-id"})
    b = event_where(stack, lambda e, want=rid(r.id): e.request_id == want)
    assert (a.tenant, b.tenant) == ("sess-a", "sess-b") and a.session_id != b.session_id
    assert a.tenant_salt != b.tenant_salt and a.session_id == scoped_session_id("sess-a", "shared-id")


def test_two_turns_without_an_id_are_one_inferred_session(stack: ServingStack) -> None:
    system = {"role": "system", "content": "You are a terse assistant. " * 3}
    msgs = [system, {"role": "user", "content": unique("what is a block?")}]
    h1, r1 = chat(stack, msgs)
    first = h1["x-session-id"]
    assert first.startswith("auto-")
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "and a chain?"}]
    h2, r2 = chat(stack, msgs)
    assert h2["x-session-id"] == first
    # the same system prompt with another first message is another conversation
    h3, _ = chat(stack, [system, {"role": "user", "content": unique("what is a block?")}])
    assert h3["x-session-id"] not in (first,) and h3["x-session-id"].startswith("auto-")
    ev = event_where(stack, lambda e: e.request_id == rid(r2.id))
    assert ev.session_id == scoped_session_id("sess-a", first) and ev.outcome is TurnOutcome.ANSWER
    assert ev.last_hash is not None and ev.chain_blocks >= 2 and ev.worker == "prefill-0"
    assert ev.started_at is not None and ev.started_at <= ev.at
    assert not ev.named  # inferred: the default policy trusts it only as far as inferred sessions earn it


def test_agent_loop_turns_are_tool_calls_with_hints(stack: ServingStack) -> None:
    sid = unique("agent")
    call = {"id": "call_1", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}
    msgs = [{"role": "user", "content": unique("list the files")}]
    _, r1 = chat(stack, msgs, tools=TOOLS, extra_headers={"x-session-id": sid,
                                                          "x-kvmesh-expected-return-ms": "1500"})
    e1 = event_where(stack, lambda e: e.request_id == rid(r1.id))
    assert e1.outcome is TurnOutcome.ANSWER and e1.expected_return_ms == 1500  # no tool results yet
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "a.txt b.txt"}]
    _, r2 = chat(stack, msgs, tools=TOOLS, extra_headers={"x-session-id": sid},
                 extra_body={"kvmesh": {"expected_return_ms": 800}})
    e2 = event_where(stack, lambda e: e.request_id == rid(r2.id))
    assert e2.outcome is TurnOutcome.TOOL_CALLS and e2.tools == ["list_files"] and e2.expected_return_ms == 800
    assert e2.chain_blocks >= e1.chain_blocks and e2.session_id == e1.session_id
    assert e1.named and e2.named  # the client named it (x-session-id)

    # Anthropic: tool_use / tool_result blocks; the hint as a body extension
    tools = [{"name": "read_file", "description": "Read a file.", "input_schema": {"type": "object"}}]
    history = [{"role": "user", "content": unique("read it")},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "# README"}]}]
    m = ant(stack).messages.create(model=stack.model_dir.name, max_tokens=3, tools=tools, messages=history,
                                   extra_body={"temperature": 0, "kvmesh": {"expected_return_ms": 2000}})
    e3 = event_where(stack, lambda e: e.request_id == rid(m.id))
    assert e3.outcome is TurnOutcome.TOOL_CALLS and e3.tools == ["read_file"] and e3.expected_return_ms == 2000

    # the turn published as an answer was revealed as a tool call by the next request: counted
    metrics = stack.metrics()
    assert 'kvmesh_ingress_session_outcome_checks_total{actual="tool_calls",published="answer"}' in metrics
    assert 'kvmesh_ingress_sessions_total{source="header"}' in metrics


def test_end_hint_and_end_endpoint(stack: ServingStack) -> None:
    msgs = [{"role": "user", "content": unique("last words")}]
    h1, r1 = chat(stack, msgs, extra_headers={"x-kvmesh-session-end": "true"})
    e1 = event_where(stack, lambda e: e.request_id == rid(r1.id))
    assert e1.outcome is TurnOutcome.ENDED and e1.last_hash is not None
    # its chain is forgotten: a request extending it is a new session
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "more"}]
    h2, _ = chat(stack, msgs)
    assert h2["x-session-id"] != h1["x-session-id"]

    # the end endpoint, on the inferred session the response named
    sid = h2["x-session-id"]
    auth = {"authorization": "Bearer sk-sess-a"}
    url = f"{stack.base_url}/v1/sessions/{sid}/end"
    for _ in range(2):  # idempotent
        r = httpx.post(url, headers=auth, timeout=10)
        assert r.status_code == 200 and r.json()["id"] == sid and r.json()["status"] == "ended"
    scoped = scoped_session_id("sess-a", sid)
    ended = event_where(stack, lambda e: e.session_id == scoped and e.outcome is TurnOutcome.ENDED)
    assert ended.last_hash is not None and ended.request_id == "" and ended.tenant == "sess-a"
    # a later event proves the second end had its chance to land: still one `ended` for the session
    _, r3 = chat(stack, [{"role": "user", "content": unique("after")}])
    event_where(stack, lambda e: e.request_id == rid(r3.id))
    assert len(events_where(stack, lambda e: e.session_id == scoped and e.outcome is TurnOutcome.ENDED)) == 1

    assert httpx.post(url, timeout=10).status_code == 401
    bad = httpx.post(f"{stack.base_url}/v1/sessions/{'x' * 300}/end", headers=auth, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"


def test_bad_input_is_a_dialect_error_and_publishes_nothing(stack: ServingStack) -> None:
    jobs, events = asyncio.run(job_count(stack.nats.url)), session_seq(stack)
    msgs = [{"role": "user", "content": unique("hello")}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(stack, msgs, extra_headers={"x-session-id": "x" * 300})
    assert err.value.body["param"] == "x-session-id"
    with pytest.raises(openai.BadRequestError) as err:
        chat(stack, msgs, extra_headers={"x-kvmesh-expected-return-ms": "soon"})
    assert err.value.body["param"] == "x-kvmesh-expected-return-ms"
    with pytest.raises(openai.BadRequestError) as err:
        chat(stack, msgs, extra_body={"kvmesh": {"session_ends": True}})
    assert err.value.body["param"] == "kvmesh.session_ends"
    with pytest.raises(openai.BadRequestError) as err:
        chat(stack, msgs, extra_headers={"x-kvmesh-parent-session-id": "p" * 300})
    assert err.value.body["param"] == "x-kvmesh-parent-session-id"
    with pytest.raises(openai.BadRequestError) as err:
        chat(stack, msgs, extra_body={"kvmesh": {"parent_session_id": ["lead"]}})
    assert err.value.body["param"] == "kvmesh.parent_session_id"
    with pytest.raises(anthropic.BadRequestError) as aerr:
        ant(stack).messages.create(model=stack.model_dir.name, max_tokens=3, messages=msgs,
                                   metadata={"user_id": "u" * 300})
    assert aerr.value.body["type"] == "error" and "metadata.user_id" in aerr.value.body["error"]["message"]
    assert asyncio.run(job_count(stack.nats.url)) == jobs and session_seq(stack) == events


def test_kv_events_name_the_session_and_hold_the_events_last_block(stack: ServingStack) -> None:
    sid = unique("kv")
    long = [{"role": "user", "content": unique("a prompt long enough to fill several blocks " * 4)}]
    _, r = chat(stack, long, extra_headers={"x-session-id": sid}, max_tokens=2 * BLOCK)
    scoped = scoped_session_id("sess-a", sid)
    ev = event_where(stack, lambda e: e.request_id == rid(r.id))
    fed = r.usage.prompt_tokens + r.usage.completion_tokens - 1  # the last sampled token has no KV
    assert ev.last_hash is not None and ev.chain_blocks == fed // BLOCK

    def names_it(data: bytes) -> bool:
        return any(isinstance(e, BlockStored) and e.session_id == scoped for e in KVEventBatch.from_bytes(data).events)

    def holds_last(data: bytes) -> bool:  # a worker stored the block the event names: the chain is real
        return any(isinstance(e, BlockStored) and ev.last_hash in e.hashes for e in KVEventBatch.from_bytes(data).events)

    asyncio.run(_wait(stack.nats.url, "KV_EVENTS", subjects.KV_EVENTS_ALL, names_it, 30.0))
    asyncio.run(_wait(stack.nats.url, "KV_EVENTS", subjects.KV_EVENTS_ALL, holds_last, 30.0))
    assert ev.worker == "prefill-0"  # retention keeps the session where its next prefill reads


def started_event(stack: ServingStack, request_id: str) -> SessionEvent:
    data = asyncio.run(_wait(stack.nats.url, "SESSIONS", subjects.SESSION_EVENTS, lambda d: (
        e := SessionEvent.from_bytes(d)).outcome is TurnOutcome.STARTED and e.request_id == request_id, 30.0))
    return SessionEvent.from_bytes(data)


def test_a_sub_agent_names_its_parent_or_is_found_to_be_forked(stack: ServingStack) -> None:
    system = {"role": "system", "content": "You plan work and hand steps to helpers. " * 3}
    lead = unique("lead")
    _, r1 = chat(stack, [system, {"role": "user", "content": unique("plan the release")}],
                 extra_headers={"x-session-id": lead})
    assert event_where(stack, lambda e: e.request_id == rid(r1.id)).parent_session_id is None  # a root
    scoped_lead = scoped_session_id("sess-a", lead)
    # a sub-agent names its lead in the header (both of its turn's events carry it), or in the body extension
    step = [system, {"role": "user", "content": unique("write the changelog")}]
    h2, r2 = chat(stack, step, extra_headers={"x-session-id": unique("helper"), "x-kvmesh-parent-session-id": lead})
    ev = event_where(stack, lambda e: e.request_id == rid(r2.id))
    assert ev.parent_session_id == scoped_lead and ev.session_id == scoped_session_id("sess-a", h2["x-session-id"])
    assert started_event(stack, rid(r2.id)).parent_session_id == scoped_lead
    _, r3 = chat(stack, [system, {"role": "user", "content": unique("tag the build")}],
                 extra_body={"kvmesh": {"parent_session_id": lead}})
    assert event_where(stack, lambda e: e.request_id == rid(r3.id)).parent_session_id == scoped_lead
    # /v1/responses keeps it when the session comes from previous_response_id
    c = oai(stack)
    first = c.responses.create(model=stack.model_dir.name, input=unique("check the docs"), max_output_tokens=3,
                               extra_headers={"x-kvmesh-parent-session-id": lead})
    sent = time.time()
    then = c.responses.with_raw_response.create(model=stack.model_dir.name, input="and the tests",
                                                max_output_tokens=3, previous_response_id=first.id,
                                                extra_headers={"x-kvmesh-parent-session-id": lead})
    scoped = scoped_session_id("sess-a", then.headers["x-session-id"])
    ev = event_where(stack, lambda e: e.session_id == scoped and e.started_at is not None and e.started_at >= sent)
    assert ev.parent_session_id == scoped_lead

    # No id, no header: a conversation that branches off another one's own turns is its fork
    task = "Read the design notes and the failing test output, then list every assumption you make. " * 2
    history = [system, {"role": "user", "content": unique("triage the bug")}]
    h4, r4 = chat(stack, history)
    history.append({"role": "assistant", "content": r4.choices[0].message.content})
    h5, _ = chat(stack, [*history, {"role": "user", "content": task + "Report to me."}])
    assert h5["x-session-id"] == h4["x-session-id"]  # the conversation went on
    h6, r6 = chat(stack, [*history, {"role": "user", "content": task + "Report to the team."}])
    assert h6["x-session-id"] != h4["x-session-id"]  # a new session, branching after the first answer
    ev = event_where(stack, lambda e: e.request_id == rid(r6.id))
    assert ev.parent_session_id == scoped_session_id("sess-a", h4["x-session-id"])
    # sharing only the system prompt is not a fork
    _, r7 = chat(stack, [system, {"role": "user", "content": unique("triage another bug")}])
    assert event_where(stack, lambda e: e.request_id == rid(r7.id)).parent_session_id is None
    assert 'kvmesh_ingress_session_parents_total{source="inferred"}' in stack.metrics()
