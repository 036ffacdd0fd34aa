"""Sessions at the ingress: every request gets one, and every finished turn says how it ended.

A dialect route calls, in order:
1. `inputs(adm, dialect)` (turn.py) right after validating the body: the explicit
   session id and the hints (shared/sessions/identity.py); malformed ones are
   a 400 in the route's dialect, before anything is published;
2. `tracker.begin(adm, inputs, prompt_ids, evidence)` once the prompt is
   tokenized: the explicit session, else the one the prompt's chain continues
   (shared/ingress/sessions/table.py), else a new one (`auto-<request hex>`).
   Its parent, for a forked session (a sub-agent): the one the request names
   (shared/sessions/lineage.py), else the one its earlier turns had, else,
   on a session's first turn, the one its prompt was forked from
   (shared/ingress/sessions/forks.py); the group's root is the parent's root.
   The tenant-scoped id goes into the job (and so the workers' KV events);
   logs carry the client's id as `session_id` (as the middleware bound the
   header), with `scoped_session_id` and `session_source`; the client's id
   comes back in the response's `x-session-id` header;
2b. `tracker.announce(turn)` once the turn's job is on the bus (the gateway calls
   it: `GenerationRequest.on_dispatched`): the turn's ``started`` event (msg id
   `<request_id>:start`), so the eviction service and the workers hold the
   session as in use while its job waits in a queue (shared/sessions/events.py).
   It goes out after the job, not before: it would compete with the job for the
   cores on the request's own path;
3. `tracker.finish(turn, ..., usage=usage)` when the last token was delivered: the turn's
   chain (prompt + output, full blocks, as the workers hash them) becomes the
   session's anchors for inference and the `SessionEvent` published on
   `subjects.SESSION_EVENTS` (msg id `<request_id>:turn`), with the outcome
   `shared/sessions/outcome.py` classifies.
The publish runs in the background: a bus that is down costs the event
(logged, counted), never the client's response; at most
`MAX_PENDING_PUBLISHES` wait at once, beyond that events are dropped and counted.
With `traffic` set (shared/ingress/sessions/traffic.py), `finish` also hands the
request's record to it: the one place served traffic is recorded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from kvmesh.bus.publish import Publisher
from kvmesh.ingress.core.metrics import IngressMetrics
from kvmesh.ingress.core.types import Usage
from kvmesh.ingress.sessions.forks import ForkIndex
from kvmesh.ingress.sessions.table import SessionRecord, SessionTable, anchor_of
from kvmesh.ingress.sessions.traffic import TrafficRecorder, build_record
from kvmesh.ingress.sessions.turn import SessionInputs, Turn, TurnRequest
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.block_hash import BlockHash, HashKeys, hash_blocks
from kvmesh.sessions.events import SessionEvent, TurnOutcome
from kvmesh.sessions.identity import (
    SessionRef,
    Source,
    scoped_session_id,
)
from kvmesh.sessions.lineage import ParentRef, ParentSource
from kvmesh.sessions.outcome import (
    Chain,
    EventFacts,
    ToolEvidence,
    TurnEnd,
    classify,
    event_msg_id,
    session_event,
    started_event,
    started_msg_id,
)

log = get_logger(__name__)

MAX_PENDING_PUBLISHES = 1024
_INGRESS_ONLY = "kvmesh.ingress.sessions"  # hash key when the model's fingerprint is unknown (no block is named)


@dataclass(frozen=True, slots=True)
class ChainHasher:
    """Block hashes of a tenant's token chain, as the workers compute them when the model's fingerprint is
    known (`named`); otherwise keyed apart, good for inference only (events then name no blocks)."""

    block_size: int
    fingerprint: str | None = None

    @property
    def named(self) -> bool:
        return self.fingerprint is not None

    def extend(self, hashes: Sequence[bytes], ids: Sequence[int], salt_hex: str) -> list[bytes]:
        """The full-block hashes of `ids`, given `hashes` of its leading full blocks (only the rest is hashed)."""
        keys = HashKeys(self.fingerprint if self.fingerprint is not None else _INGRESS_ONLY, bytes.fromhex(salt_hex))
        done = len(hashes) * self.block_size
        parent = BlockHash(hashes[-1]) if hashes else None
        return [*hashes, *hash_blocks(ids[done:], self.block_size, keys, parent)]


class SessionTracker:
    """One per ingress process (on `IngressState.sessions`); see the module docstring."""

    def __init__(self, table: SessionTable, hasher: ChainHasher, metrics: IngressMetrics,
                 publisher: Publisher | None, forks: ForkIndex | None = None) -> None:
        self.table, self.hasher, self.metrics, self.publisher = table, hasher, metrics, publisher
        self.forks = forks if forks is not None else ForkIndex(hasher.block_size)
        self._pending: set[asyncio.Task[None]] = set()
        self.traffic: TrafficRecorder | None = None  # set by the service wiring (shared/ingress/server/service.py)

    def begin(self, adm: TurnRequest, given: SessionInputs, prompt_ids: list[int], evidence: ToolEvidence) -> Turn:
        tenant = adm.principal.tenant
        hashes = self.hasher.extend([], prompt_ids, adm.principal.salt)
        if given.explicit is not None:
            ref = SessionRef(tenant, given.explicit[1], given.explicit[0])
        elif (found := self.table.find(tenant, prompt_ids, hashes)) is not None:
            ref = SessionRef(tenant, found.ref.client_id, Source.INFERRED)
        else:
            ref = SessionRef(tenant, "auto-" + adm.request_id.removeprefix("req_"), Source.NEW)
        previous = self.table.get(tenant, ref.client_id)
        if previous is not None and previous.published in (TurnOutcome.ANSWER, TurnOutcome.TOOL_CALLS):
            self.metrics.outcome_checks.labels(previous.published.value, evidence.previous_turn.value).inc()
        self.metrics.sessions.labels(ref.source.value).inc()
        structlog.contextvars.bind_contextvars(session_id=ref.client_id, scoped_session_id=ref.session_id,
                                               session_source=ref.source.value)
        parent = self._parent(ref, given.parent, previous, hashes)
        if parent is not None:
            self.metrics.session_parents.labels(parent.source.value).inc()
            structlog.contextvars.bind_contextvars(parent_session_id=parent.client_id,
                                                   parent_source=parent.source.value)
        return Turn(ref, given.hints, evidence, adm.request_id, adm.principal.salt, time.time(), prompt_ids, hashes,
                    adm.path, time.monotonic(), parent, self._root(ref, parent))

    def _parent(self, ref: SessionRef, named: ParentRef | None, previous: SessionRecord | None,
                prompt_hashes: list[bytes]) -> ParentRef | None:
        """The parent the request names (a session is never its own), else the one the session's earlier turns
        had, else, on its first turn here, the session its prompt was forked from (forks.py)."""
        if named is not None and named.client_id != ref.client_id:
            return named
        if previous is not None:
            return previous.parent
        found = self.forks.parent_of(ref.tenant, ref.client_id, prompt_hashes, self.table)
        return None if found is None else ParentRef(found.ref.client_id, ParentSource.INFERRED)

    def _root(self, ref: SessionRef, parent: ParentRef | None) -> str:
        """The client id of the group's root: the parent's root as far as this process knows it ("": the
        session is its own root, also when the parent's root turns out to be the session itself)."""
        if parent is None:
            return ""
        known = self.table.get(ref.tenant, parent.client_id)
        root = (known.root or parent.client_id) if known is not None else parent.client_id
        return "" if root == ref.client_id else root

    def announce(self, turn: Turn) -> None:
        """Publish the turn's started event (background; a failure costs the signal, never the request).
        Called once the turn's job is on the bus (`GenerationRequest.on_dispatched`), not by `begin`."""
        try:
            named = self.hasher.named and bool(turn.prompt_hashes)
            chain = Chain(turn.prompt_hashes[-1].hex() if named else None, len(turn.prompt_hashes) if named else 0)
            facts = EventFacts(turn.ref.tenant, turn.tenant_salt, turn.session_id, turn.request_id,
                               turn.hints.expected_return_ms, turn.started_at, chain, turn.ref.named,
                               turn.parent_session_id)
            self._publish_later(started_event(facts), started_msg_id(facts))
        except Exception:  # noqa: BLE001 - advice lost, never the client's request
            self.metrics.session_event_failures.inc()
            log.exception("session turn start not announced")

    def finish(self, turn: Turn, output_ids: Sequence[int], answer_ids: Sequence[int] | None,
               finish_reason: str | None, worker: str, parsed_tools: Sequence[str] = (),
               usage: Usage | None = None) -> None:
        """The turn ended: remember its anchors, classify it and publish its event (in the background).
        `parsed_tools`: the names of the tool calls parsed from the output. With `usage`, the request's
        traffic record goes to `traffic` too. Never raises: the client's response does not depend on it."""
        try:
            self._finish(turn, output_ids, answer_ids, finish_reason, worker, tuple(parsed_tools))
        except Exception:  # noqa: BLE001 - a bug here must cost the event, not the answer
            self.metrics.session_event_failures.inc()
            log.exception("session turn not recorded")
        if self.traffic is not None and usage is not None:
            self._record(turn, usage, len(output_ids), finish_reason, parsed_tools)

    def _record(self, turn: Turn, usage: Usage, output_tokens: int, finish_reason: str | None,
                parsed_tools: Sequence[str]) -> None:
        assert self.traffic is not None
        try:
            record = build_record(turn, usage, output_tokens, finish_reason, parsed_tools, self.hasher.block_size)
        except Exception:  # noqa: BLE001 - a bug here costs the record (counted), not the answer
            log.exception("traffic record not built")
            record = None
        self.traffic.record(turn.request_id, record)

    def _finish(self, turn: Turn, output_ids: Sequence[int], answer_ids: Sequence[int] | None,
                finish_reason: str | None, worker: str, parsed_tools: tuple[str, ...]) -> None:
        salt, prompt = turn.tenant_salt, turn.prompt_ids
        # The last sampled token is never fed back, so the workers hold KV up to the one before it.
        fed = self.hasher.extend(turn.prompt_hashes, [*prompt, *output_ids[:-1]], salt)
        chain = Chain(fed[-1].hex() if fed and self.hasher.named else None,
                      len(fed) if self.hasher.named else 0, worker)
        anchors = [anchor_of(prompt, turn.prompt_hashes, self.hasher.block_size)]
        quoted = turn.prompt_hashes  # the chain the next prompt starts with
        if answer_ids:
            extended = [*prompt, *answer_ids]
            quoted = self.hasher.extend(turn.prompt_hashes, extended, salt)
            anchors.append(anchor_of(extended, quoted, self.hasher.block_size))
        outcome, tools = classify(TurnEnd(turn.evidence, finish_reason, turn.hints.session_end, parsed_tools))
        rec = self.table.record(turn.ref)
        rec.last_request_id, rec.chain, rec.published, rec.ended = turn.request_id, chain, outcome, False
        rec.parent, rec.root = turn.parent, turn.root
        if rec.first_tokens is None:
            rec.first_tokens = len(prompt)
        self.forks.index(rec, quoted)
        if outcome is TurnOutcome.ENDED:
            self.table.end(turn.ref.tenant, turn.ref.client_id)
        else:
            self.table.turn_ended(rec, anchors)
        facts = EventFacts(turn.ref.tenant, salt, turn.session_id, turn.request_id, turn.hints.expected_return_ms,
                           turn.started_at, chain, turn.ref.named, turn.parent_session_id)
        self._publish_later(session_event(facts, outcome, tools, time.time()), event_msg_id(facts, outcome))

    async def end(self, tenant: str, tenant_salt: str, client_id: str) -> SessionEvent:
        """The client ended the session: publish ENDED now (raises PublishError if the bus will not take it).

        The chain is the last turn's when this process served it; unknown sessions are ended too
        (another replica may have served them), so ending is idempotent and never a 404."""
        rec = self.table.end(tenant, client_id)
        chain = rec.chain if rec is not None else Chain()
        parent = rec.parent if rec is not None else None
        facts = EventFacts(tenant, tenant_salt, scoped_session_id(tenant, client_id), chain=chain,
                           parent_session_id=None if parent is None else scoped_session_id(tenant, parent.client_id))
        event = session_event(facts, TurnOutcome.ENDED, [], time.time())
        await self._publish(event, event_msg_id(facts, TurnOutcome.ENDED))
        return event

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for the events still being published (shutdown)."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)

    # --- publishing ----------------------------------------------------

    def _publish_later(self, event: SessionEvent, msg_id: str) -> None:
        if self.publisher is None:
            return
        if len(self._pending) >= MAX_PENDING_PUBLISHES:
            self.metrics.session_event_failures.inc()
            log.warning("session event dropped: too many waiting for the bus", outcome=event.outcome.value)
            return
        task = asyncio.create_task(self._publish_logged(event, msg_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish_logged(self, event: SessionEvent, msg_id: str) -> None:
        try:
            await self._publish(event, msg_id)
        except Exception as exc:  # noqa: BLE001 - advice lost, never the client's request
            self.metrics.session_event_failures.inc()
            log.warning("session event not published", outcome=event.outcome.value, error=repr(exc))

    async def _publish(self, event: SessionEvent, msg_id: str) -> None:
        if self.publisher is None:
            return
        await self.publisher.publish(subjects.SESSION_EVENTS, event, msg_id=msg_id)
        self.metrics.session_events.labels(event.outcome.value).inc()
        log.info("session event", outcome=event.outcome.value, tools=event.tools, chain_blocks=event.chain_blocks,
                 worker=event.worker, expected_return_ms=event.expected_return_ms)
