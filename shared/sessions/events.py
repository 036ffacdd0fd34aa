"""Turn outcomes: what the ingress tells the fleet when a session's turn ends.

An agent's turn ends in one of three ways, and each predicts the next use of
the session's KV differently:

- ``tool_calls``: the agent runs the named tools and comes back with their
  results, usually within seconds;
- ``answer``: a person reads the answer and maybe replies (minutes), or the
  session is over;
- ``ended``: the client said the session is over (the end endpoint, or a
  hint); its unshared blocks can go first.

One more kind is not an end: ``started`` says the ingress admitted a turn
of the session (`started_at` = `at`), before its job is queued. From then
on the session is in use: on a saturated pool its job may wait in a queue
well past the predicted return, and a consumer that learnt of the turn only
from the job would take the waiting session for overdue and evict the very
chain the job is about to read. A started event names the prompt's last
full block (`last_hash`, often not computed yet) and no worker.

One `SessionEvent` per admitted turn (``started``) and one per ended turn go
to `subjects.SESSION_EVENTS` (stream SESSIONS), in that order per turn. `last_hash` is the last full block of the turn's chain
(the prompt plus what was generated, as far as blocks are full), so a
consumer can find the whole chain from it (the index, the KV events).
`expected_return_ms` is the client's hint, when it gave one;
`parent_session_id` names a forked session's parent. Consumers
(eviction, routing) treat events as advice: a lost one costs cache hits,
never correctness.
"""

from __future__ import annotations

from enum import StrEnum

from kvmesh.kv_events.events import HexHash
from kvmesh.protocol.base import Message
from pydantic import Field


class TurnOutcome(StrEnum):
    TOOL_CALLS = "tool_calls"
    ANSWER = "answer"
    ENDED = "ended"
    STARTED = "started"  # not an end: the turn was admitted (see the module docstring)


class SessionEvent(Message):
    """Session `session_id` of `tenant` ended a turn (or ended), or started one (`STARTED`), at `at` (unix s)."""

    SCHEMA_VERSION = 2  # 2: `named`, `parent_session_id`

    tenant: str = Field(min_length=1)
    tenant_salt: str = ""  # hex, as in the session's jobs: what a worker needs to prefetch its blocks
    session_id: str = Field(min_length=1)
    request_id: str = ""  # the request whose turn ended ("" for an explicit end)
    outcome: TurnOutcome
    tools: list[str] = Field(default_factory=list)  # tool names called, for TOOL_CALLS
    last_hash: HexHash | None = None  # the chain's last full block (None: no full block, or an explicit end)
    chain_blocks: int = Field(default=0, ge=0)  # blocks in that chain
    # The prefill worker that served the turn: routing sends the session back there and its next prefill
    # reads that worker's L1 first, so that is where retention keeps it ("" if unknown).
    worker: str = ""
    expected_return_ms: int | None = Field(default=None, ge=0)  # the client's hint
    started_at: float | None = None  # when this turn's request arrived: the gap since the last turn is learned from it
    # The client named the session (its id came with the request) rather than the ingress inferring it:
    # the default eviction policy trusts a named session's new blocks (shared/cache_policy/default.py).
    named: bool = False
    # The session this one was forked from (a sub-agent's parent), scoped to `tenant` as `session_id` is;
    # named by the client or inferred from a shared chain. Retention keeps the prefix they share while
    # any session of their group is active (shared/eviction/session_groups.py). None: a root session.
    parent_session_id: str | None = Field(default=None, min_length=1)
    at: float
