"""Turn outcomes: tool evidence from a request's messages, the classification rule, the event it builds."""

from __future__ import annotations

from kvmesh.sessions.events import SessionEvent, TurnOutcome
from kvmesh.sessions.outcome import (
    Chain,
    EventFacts,
    ToolEvidence,
    TurnEnd,
    classify,
    event_msg_id,
    session_event,
    tool_evidence,
)

TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]


def _call(cid: str, name: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": {}}}


def _agent_step(*results: str) -> list[dict]:
    """A conversation whose last assistant turn called ls and grep; `results` answer those call ids."""
    msgs = [{"role": "user", "content": "find it"},
            {"role": "assistant", "content": "", "tool_calls": [_call("c1", "ls"), _call("c2", "grep")]}]
    return msgs + [{"role": "tool", "content": "out", "tool_call_id": r} for r in results]


def test_evidence_names_the_calls_the_trailing_results_answer() -> None:
    ev = tool_evidence(_agent_step("c2"), TOOLS)
    assert ev == ToolEvidence(declared=True, tool_results=True, answered=("grep",))
    assert ev.previous_turn is TurnOutcome.TOOL_CALLS
    # results without matching ids still answer that turn's calls
    assert tool_evidence(_agent_step("zz"), TOOLS).answered == ("ls", "grep")


def test_a_user_reply_after_the_answer_is_no_tool_evidence() -> None:
    msgs = _agent_step("c1", "c2") + [{"role": "assistant", "content": "found"}, {"role": "user", "content": "ok"}]
    ev = tool_evidence(msgs, TOOLS)
    assert not ev.tool_results and ev.previous_turn is TurnOutcome.ANSWER
    assert tool_evidence([{"role": "user", "content": "hi"}], None) == ToolEvidence()


def test_anthropic_results_followed_by_text_still_count() -> None:
    msgs = _agent_step("c1") + [{"role": "user", "content": "and be quick"}]
    assert tool_evidence(msgs, TOOLS).answered == ("ls",)


def test_classification_rule() -> None:
    loop = tool_evidence(_agent_step("c1", "c2"), TOOLS)
    no_tools_offered = tool_evidence(_agent_step("c1", "c2"), None)
    first_turn = tool_evidence([{"role": "user", "content": "go"}], TOOLS)
    assert classify(TurnEnd(loop, "stop", session_end=True)) == (TurnOutcome.ENDED, [])
    assert classify(TurnEnd(first_turn, "stop", parsed_tools=("cat", "cat"))) == (TurnOutcome.TOOL_CALLS, ["cat"])
    assert classify(TurnEnd(first_turn, "tool_use")) == (TurnOutcome.TOOL_CALLS, [])
    assert classify(TurnEnd(loop, "stop")) == (TurnOutcome.TOOL_CALLS, ["ls", "grep"])
    assert classify(TurnEnd(loop, "length")) == (TurnOutcome.TOOL_CALLS, ["ls", "grep"])
    assert classify(TurnEnd(no_tools_offered, "stop")) == (TurnOutcome.ANSWER, [])
    assert classify(TurnEnd(first_turn, "end_turn")) == (TurnOutcome.ANSWER, [])


def test_event_and_msg_ids() -> None:
    chain = Chain("ab" * 32, 3, "decode-0")
    facts = EventFacts("alpha", "00", "s-1", "req_1", 2500, 10.0, chain)
    ev = session_event(facts, TurnOutcome.TOOL_CALLS, ["ls"], at=11.0)
    assert SessionEvent.from_bytes(ev.to_bytes()) == ev
    assert (ev.last_hash, ev.chain_blocks, ev.worker, ev.expected_return_ms) == ("ab" * 32, 3, "decode-0", 2500)
    assert event_msg_id(facts, TurnOutcome.TOOL_CALLS) == "req_1:turn"
    end = EventFacts("alpha", "00", "s-1", chain=chain)
    assert event_msg_id(end, TurnOutcome.ENDED) == event_msg_id(end, TurnOutcome.ENDED) != "req_1:turn"
    assert event_msg_id(EventFacts("alpha", "00", "s-1"), TurnOutcome.ENDED) != event_msg_id(end, TurnOutcome.ENDED)
