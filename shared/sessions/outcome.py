"""How a turn ended, classified from what the ingress knows when it ends; and the event that says so.

The ingress parses tool calls out of the output when the request offered
tools and did not turn them off (shared/toolcalls/; tool_choice "none" and
requests without tools are not parsed). `classify` works from what it
knows, in this order:

1. the client's session-end hint: ENDED;
2. tool calls parsed from the output (`parsed_tools`) or a tool-call finish
   reason (`tool_calls` / `tool_use`): TOOL_CALLS with the parsed names;
3. the request offered tools and is itself an agent loop step: its
   messages after the last assistant turn carry tool results (OpenAI `tool`
   messages, Anthropic `tool_result` blocks). Then the agent is mid-loop and
   this turn most likely calls tools again: TOOL_CALLS, naming the tools whose
   results this request carried (the loop's latest step; a guess at the
   names, the best the ingress has without parsing);
4. otherwise ANSWER.

Rule 3 only matters where rule 2 cannot see: output the parser does not
recognise as calls (a model writing another syntax than its template's,
tool_choice "none"). There it misses a loop's first tool call (no results in
its request yet) and calls the loop's final answer a tool call. Both errors are cheap for the
consumer: a missed one loses a pin, a false one holds a short pin that
lapses. The next request settles what the previous turn really did
(`previous_turn`); the ingress counts that against what it published
instead of publishing a correction, which would reach eviction after the
session was already back and count as a turn of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.sessions.events import SessionEvent, TurnOutcome

TOOL_FINISH_REASONS = frozenset({"tool_calls", "tool_use"})  # OpenAI finish_reason, Anthropic stop_reason


@dataclass(frozen=True, slots=True)
class ToolEvidence:
    """What a request's own messages say about tools: whether it offers any, and the calls its trailing
    tool results answer (the previous turn's tool calls; empty when it ended with an answer)."""

    declared: bool = False
    tool_results: bool = False  # messages after the last assistant turn carry tool results
    answered: tuple[str, ...] = ()  # the names of the calls they answer, as far as the history names them

    @property
    def previous_turn(self) -> TurnOutcome:
        """How the turn before this request really ended, as this request shows it."""
        return TurnOutcome.TOOL_CALLS if self.tool_results else TurnOutcome.ANSWER


def tool_evidence(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None) -> ToolEvidence:
    """Evidence from chat-template messages (both dialects flatten to these: `role`, `content`,
    `tool_calls` in the OpenAI shape, `tool` messages with `tool_call_id`)."""
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    results = [m for m in messages[last_assistant + 1:] if m.get("role") == "tool"]
    if last_assistant < 0 or not results:
        return ToolEvidence(bool(tools))
    calls = messages[last_assistant].get("tool_calls") or []
    answered_ids = {m.get("tool_call_id") for m in results}
    named = [(c.get("id"), (c.get("function") or {}).get("name")) for c in calls if isinstance(c, dict)]
    names = [n for cid, n in named if isinstance(n, str) and n and cid in answered_ids]
    if not names:  # results without matching ids: the calls of that turn are still what they answer
        names = [n for _, n in named if isinstance(n, str) and n]
    return ToolEvidence(bool(tools), True, tuple(dict.fromkeys(names)))


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """What is known when a turn ends."""

    evidence: ToolEvidence
    finish_reason: str | None
    session_end: bool = False
    parsed_tools: tuple[str, ...] = ()  # names of the tool calls parsed from the output, in order


def classify(turn: TurnEnd) -> tuple[TurnOutcome, list[str]]:
    """The outcome and tool names to publish; the rule is in the module docstring."""
    if turn.session_end:
        return TurnOutcome.ENDED, []
    if turn.parsed_tools or turn.finish_reason in TOOL_FINISH_REASONS:
        return TurnOutcome.TOOL_CALLS, list(dict.fromkeys(turn.parsed_tools))
    if turn.evidence.declared and turn.evidence.tool_results:
        return TurnOutcome.TOOL_CALLS, list(turn.evidence.answered)
    return TurnOutcome.ANSWER, []


@dataclass(frozen=True, slots=True)
class Chain:
    """The turn's chain as the workers hold it: its last full block (hex) and its length in blocks."""

    last_hash: str | None = None
    blocks: int = 0
    worker: str = ""  # the worker whose L1 holds it (the one that finished the request)


@dataclass(frozen=True, slots=True)
class EventFacts:
    """Who and when: the parts of a session event that do not depend on the outcome."""

    tenant: str
    tenant_salt: str
    session_id: str
    request_id: str = ""
    expected_return_ms: int | None = None
    started_at: float | None = None
    chain: Chain = field(default_factory=Chain)
    named: bool = False  # the client named the session
    parent_session_id: str | None = None  # the session it was forked from, scoped to the tenant


def session_event(facts: EventFacts, outcome: TurnOutcome, tools: list[str], at: float) -> SessionEvent:
    return SessionEvent(tenant=facts.tenant, tenant_salt=facts.tenant_salt, session_id=facts.session_id,
                        request_id=facts.request_id, outcome=outcome, tools=tools,
                        last_hash=facts.chain.last_hash, chain_blocks=facts.chain.blocks,
                        worker=facts.chain.worker, expected_return_ms=facts.expected_return_ms,
                        started_at=facts.started_at, named=facts.named,
                        parent_session_id=facts.parent_session_id, at=at)


def event_msg_id(facts: EventFacts, outcome: TurnOutcome) -> str:
    """Nats-Msg-Id: one event per turn (a republish of the same turn is dropped); an explicit end is one
    per session and last turn (ending twice is one event)."""
    if facts.request_id:
        return f"{facts.request_id}:turn"
    return f"{facts.session_id}:{outcome.value}:{facts.chain.last_hash or 'none'}"


def started_event(facts: EventFacts) -> SessionEvent:
    """The turn `facts.request_id` was admitted at `facts.started_at`: the session is in use from then on
    (its chain names the prompt's full blocks; no worker has it yet)."""
    assert facts.started_at is not None and facts.request_id
    return session_event(facts, TurnOutcome.STARTED, [], facts.started_at)


def started_msg_id(facts: EventFacts) -> str:
    """Nats-Msg-Id of a turn's started event: one per request, apart from its end's."""
    return f"{facts.request_id}:start"
