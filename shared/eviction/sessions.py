"""Session retention: from how each agent turn ended to Retain and Demote advice.

Offline Belady wins by knowing when a block is next used; an agent session
says so when its turn ends (shared/sessions/events.py). For each
`SessionEvent` the planner

1. finds the session's chain: `last_hash` walked back through the parent
   links the KV events gave (`OccupancyView.stats`);
2. tells the `SessionBook` (and through it the `ReturnPredictor`) the turn
   started (`started_at`: the gap since the last turn is learned; the
   prediction's error goes to a metric), which blocks it sent, and how it
   ended. The book is the one the session-aware policy ranks by
   (shared/cache_policy/session.py), so the advisor's demotions and these
   pins read the same predictions;
3. advises by the predicted return:
   - back within `pin_horizon_s` (a tool call): `Retain` the chain in the
     worker's L1 until the predictor's deadline (a high quantile of the gap,
     so the pin outlives most tool runs) plus `pin_margin_s`, within the
     session pin budget (`pin_fraction` of the worker's L1, in which the
     chains of turns admitted on that worker count first: their prefills
     need the room now, and pins granted earlier count until they lapse:
     a worker's pin cannot be taken back); past the budget only the
     chain's leading blocks that fit are pinned (`partial_retains`), and a
     chain none of which fits is tried again as a prefetch;
   - back later (an answer, a person reading): no pin, so the blocks go down
     to L2/L3 under pressure like any others; `prefetch_lead_s` before the
     predicted return (if a return is likely: `min_p_return`) a `Retain` with
     `fetch` brings the chain back into L1;
   - ended: its unshared blocks (claimed by no other tracked session) still
     in L1 are demoted to L2 at once, leaves first, ahead of everything else.

A ``started`` event (the ingress admitted the session's next turn) marks
the session in use before its job is queued: the book ranks it as in use,
so the advisor does not demote a session that waits in a queue past its
predicted return; with `in_use_hold_s` > 0 its chain is also pinned that
long (within the pin budget, ahead of every session that is away) until the
turn's end event plans anew. Off by default: pins are references no prefill
can evict around, and holds for every queued turn stalled admissions live.

Forked sessions (a sub-agent names its parent: `parent_session_id`) form a
group with their root (shared/eviction/session_groups.py). While any member
is active (a turn admitted, or expected back within `pin_horizon_s`), the
run of each parent's chain that its children share is pinned on the
parent's worker too, within the same budget, and fetched back with a
member's prefetch; an ended parent's demotion spares the run a child still
shares, even a child whose first turn is still in flight.

Late and wasted prefetches are counted: late when the session came back
before its prefetch was sent, wasted when its pin lapsed unused. Everything
is advice: a lost event or command costs hits, never correctness. State is
bounded (`max_sessions`, least recently active forgotten first).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from kvmesh.config import SessionRetentionSettings
from kvmesh.eviction.messages import Demote, Retain, WorkerCommand
from kvmesh.eviction.occupancy import OccupancyView
from kvmesh.eviction.pin_room import PinRoom
from kvmesh.eviction.session_groups import SessionGroups, SharedPrefix
from kvmesh.protocol.blocks import Tier
from kvmesh.sessions.book import SessionBook
from kvmesh.sessions.events import SessionEvent, TurnOutcome


@dataclass(slots=True)
class TrackedSession:
    key: tuple[str, str]  # (tenant, session id): ids are scoped to their tenant
    worker: str
    tenant_salt: str
    chain: list[bytes]
    expected_at: float = math.inf  # the predicted next turn (median)
    deadline: float = math.inf  # most such sessions are back by then (a high quantile)
    pinned_until: float = 0.0  # 0: not pinned
    pinned_len: int = 0  # the leading blocks of `chain` that pin covers (the budget may take fewer than all)
    prefetch_at: float | None = None  # when to send the prefetch; None: none planned or already sent
    prefetched_at: float | None = None
    started_request: str = ""  # the request whose turn started (announced) and has not ended yet
    ended_request: str = ""  # the latest request whose turn ended: its started event, if late, is stale
    announced_blocks: int = 0  # the prompt's full blocks its latest started event named


@dataclass(slots=True)
class RetentionCounts:
    retains: int = 0
    prefetches: int = 0
    late_prefetches: int = 0  # the session came back before its prefetch went out
    wasted_prefetches: int = 0  # a prefetched session's pin lapsed before it came back
    budget_refusals: int = 0  # a session that would have been pinned but the budget was full
    partial_retains: int = 0  # only a leading part of the chain fit the budget: that part was pinned
    ended_demoted: int = 0  # blocks of ended sessions demoted at once
    group_retains: int = 0  # shared prefixes of forked groups pinned (or fetched back) on the parent's worker
    errors: list[float] = field(default_factory=list)  # signed prediction errors (s) not yet exported


class SessionRetention:
    """`on_event(ev, now)` and `tick(now)` return the commands to send; `counts` feeds the metrics."""

    def __init__(self, view: OccupancyView, book: SessionBook, settings: SessionRetentionSettings,
                 l1_capacity: int) -> None:
        self.view, self.book, self.settings = view, book, settings
        self.sessions: OrderedDict[tuple[str, str], TrackedSession] = OrderedDict()
        self.claims: dict[bytes, int] = {}  # block -> tracked sessions whose chain holds it
        self.groups = SessionGroups()  # forked sessions: their links and the shared prefixes pinned for them
        # a worker's own L1 size comes from its heartbeat (the view); `l1_capacity` where it states none
        self.room = PinRoom(view, settings, l1_capacity, self.sessions, self.groups)
        self.counts = RetentionCounts()

    def pin_budget(self, worker: str) -> int:
        """`pin_fraction` of `worker`'s L1 (shared/eviction/pin_room.py)."""
        return self.room.budget(worker)

    def pinned_blocks(self, worker: str, now: float) -> int:
        """Distinct blocks the planner has pinned on `worker` (a shared system prompt counts once)."""
        return self.room.pinned(worker, now)

    def in_turn(self, tenant: str, session_id: str) -> bool:
        """Whether the book holds the session as in use: a turn started and has not ended."""
        return self.book.in_turn(self._book_id((tenant, session_id)))

    def on_event(self, ev: SessionEvent, now: float) -> list[WorkerCommand]:
        key = (ev.tenant, ev.session_id)
        sid = self._book_id(key)
        old = self.sessions.get(key)
        if ev.parent_session_id is not None:  # the book ranks what a group shares by its earliest return
            self.book.link(sid, self._book_id((ev.tenant, ev.parent_session_id)))
        if ev.outcome is TurnOutcome.STARTED:
            return self._started(ev, key, old, now)
        chain = self._chain(ev)
        if old is not None and ev.request_id and old.started_request == ev.request_id:
            pass  # the turn's start was announced: the book and the predictor have it
        elif ev.started_at is not None:
            if old is not None and old.prefetch_at is not None and ev.started_at < old.prefetch_at:
                self.counts.late_prefetches += 1
            err = self.book.turn_started(sid, chain, ev.started_at, explicit=ev.named)
            if err is not None:
                self.counts.errors.append(err)
        hint = None if ev.expected_return_ms is None else ev.expected_return_ms / 1000.0
        self.book.turn_ended(sid, ev.at, ev.outcome, ev.tools, hint, hashes=chain)
        session = self._track(key, ev, chain)
        session.started_request, session.ended_request = "", ev.request_id
        if ev.outcome is TurnOutcome.ENDED:
            out = self._demote_unshared(session)
            self._forget(key)
            return out
        outlook = self.book.outlook(sid)
        session.expected_at = outlook.expected_at if outlook is not None else math.inf
        session.deadline = outlook.deadline if outlook is not None else math.inf
        session.pinned_until, session.prefetch_at, session.prefetched_at = 0.0, None, None
        if not session.chain or not session.worker or outlook is None:
            return []
        s = self.settings
        if session.expected_at - now <= s.pin_horizon_s:
            cmd = self._retain(session, now, fetch=False)
            if cmd is None:
                # No room now: pins lapse as sessions come back, so try again as a prefetch before it returns.
                session.prefetch_at = session.expected_at - s.prefetch_lead_s
            return ([] if cmd is None else [cmd]) + self._keep_group(session, now, fetch=False,
                                                                      until=self._until(session))
        if session.expected_at < math.inf and outlook.p_return >= s.min_p_return:
            session.prefetch_at = session.expected_at - s.prefetch_lead_s
        return []

    def _started(self, ev: SessionEvent, key: tuple[str, str], session: TrackedSession | None,
                 now: float) -> list[WorkerCommand]:
        """The session's turn was admitted: in use from `ev.at` until its end event; hold its chain."""
        if session is not None and ev.request_id and session.ended_request == ev.request_id:
            return []  # delivered after its own end
        if session is not None and session.prefetch_at is not None and ev.at < session.prefetch_at:
            self.counts.late_prefetches += 1
        err = self.book.turn_announced(self._book_id(key), ev.at, explicit=ev.named)
        if err is not None:
            self.counts.errors.append(err)
        if session is None:
            if ev.parent_session_id is None:
                return []  # a first turn: nothing of it is cached yet
            # A forked session's first turn: its prompt starts with what it shares with its parent.
            walked = self._chain(ev)
            session = self._track(key, ev, walked if len(walked) == ev.chain_blocks else [])
        self.sessions.move_to_end(key)
        self._link(key, ev)
        session.started_request, session.prefetch_at, session.prefetched_at = ev.request_id, None, None
        session.announced_blocks = ev.chain_blocks
        session.expected_at = session.deadline = ev.at  # back now: ahead of every session still away
        out = self._keep_group(session, now, fetch=False, until=ev.at + self.settings.pin_horizon_s)
        if not session.chain or not session.worker or self.settings.in_use_hold_s <= 0:
            return out
        cmd = self._retain(session, now, fetch=False, until=now + self.settings.in_use_hold_s)
        return out if cmd is None else [cmd, *out]

    def tick(self, now: float) -> list[WorkerCommand]:
        """Prefetches that are due; lapsed pins of prefetched sessions that never came back are counted."""
        self.book.advance(now)
        self.groups.prune(now)
        out: list[WorkerCommand] = []
        for session in list(self.sessions.values()):
            if session.prefetched_at is not None and 0.0 < session.pinned_until <= now:
                self.counts.wasted_prefetches += 1
                session.prefetched_at, session.pinned_until = None, 0.0
            if session.prefetch_at is not None and session.prefetch_at <= now:
                session.prefetch_at = None
                cmd = self._retain(session, now, fetch=True)
                if cmd is not None:
                    session.prefetched_at = now
                    self.counts.prefetches += 1
                    out.append(cmd)
                    out += self._keep_group(session, now, fetch=True, until=session.pinned_until)
        return out

    # --- internals ---------------------------------------------------------

    @staticmethod
    def _book_id(key: tuple[str, str]) -> str:
        return f"{key[0]}\x1f{key[1]}"

    def _chain(self, ev: SessionEvent) -> list[bytes]:
        """Root-first chain ending at `last_hash`, as far as the view knows its parents."""
        if ev.last_hash is None:
            return []
        chain, h = [], bytes.fromhex(ev.last_hash)
        limit = max(ev.chain_blocks, 1)
        while h is not None and len(chain) < limit:
            chain.append(h)
            info = self.view.stats.get(h)
            h = info.parent_hash if info is not None else None
        chain.reverse()
        return chain

    def _track(self, key: tuple[str, str], ev: SessionEvent, chain: list[bytes]) -> TrackedSession:
        session = self.sessions.pop(key, None)
        if session is None:
            session = TrackedSession(key, ev.worker, ev.tenant_salt, [])
        if chain or ev.outcome is not TurnOutcome.ENDED:  # an explicit end names no chain: keep the last one
            self._claim(session.chain, -1)
            session.chain = chain
            self._claim(chain, +1)
        session.worker = ev.worker or session.worker
        session.tenant_salt = ev.tenant_salt or session.tenant_salt
        self.sessions[key] = session  # most recently active last
        self._link(key, ev)
        while len(self.sessions) > self.settings.max_sessions:
            oldest = next(iter(self.sessions))
            self._forget(oldest)  # the book bounds its own sessions
        return session

    def _forget(self, key: tuple[str, str]) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            self._claim(session.chain, -1)
        self.groups.forget(key)

    def _link(self, key: tuple[str, str], ev: SessionEvent) -> None:
        if ev.parent_session_id is not None:
            self.groups.link(key, (ev.tenant, ev.parent_session_id))

    def _claim(self, chain: list[bytes], delta: int) -> None:
        for h in chain:
            n = self.claims.get(h, 0) + delta
            if n > 0:
                self.claims[h] = n
            else:
                self.claims.pop(h, None)

    def _retain(self, session: TrackedSession, now: float, fetch: bool,
                until: float | None = None) -> WorkerCommand | None:
        if until is None:
            until = self._until(session)
        n = self.room.room(session.worker, session.chain, now, session)
        if n == 0:
            self.counts.budget_refusals += 1
            return None
        self.counts.partial_retains += n < len(session.chain)
        session.pinned_until, session.pinned_len = until, n
        self.counts.retains += 1
        cmd = Retain(hashes=[h.hex() for h in session.chain[:n]], until=until, fetch=fetch,
                     tenant_salt=session.tenant_salt, session_id=session.key[1])
        kind = "prefetch" if fetch else "retain"
        cid = f"{kind}-{session.worker}-{session.chain[n - 1].hex()[:32]}-{int(until)}"
        return WorkerCommand(worker=session.worker, command_id=cid, command=cmd)

    def _until(self, session: TrackedSession) -> float:
        """When a pin for the session's predicted return lapses."""
        return min(session.deadline, session.expected_at + self.settings.pin_horizon_s) + self.settings.pin_margin_s

    def _keep_group(self, member: TrackedSession, now: float, fetch: bool, until: float) -> list[WorkerCommand]:
        """`member` is active until `until`: pin (with `fetch`: bring back) its group's shared prefixes."""
        out = []
        for prefix in self.groups.shared_prefixes(member.key, self.sessions):
            cmd = self._pin_prefix(prefix, now, fetch, until)
            if cmd is not None:
                out.append(cmd)
        return out

    def _pin_prefix(self, prefix: SharedPrefix, now: float, fetch: bool, until: float) -> WorkerCommand | None:
        """A Retain of the leading part of `prefix` that fits the budget; None if already pinned that long
        (a member's own pin on the same worker covers it) or if nothing fits."""
        if not fetch and self.room.covered(prefix.worker, prefix.blocks[-1], until):
            return None
        n = self.room.room(prefix.worker, prefix.blocks, now)
        if n == 0:
            self.counts.budget_refusals += 1
            return None
        blocks = self.groups.pin(prefix.worker, prefix.blocks[:n], until)
        self.counts.partial_retains += n < len(prefix.blocks)
        self.counts.group_retains += 1
        cmd = Retain(hashes=[h.hex() for h in blocks], until=until, fetch=fetch,
                     tenant_salt=self.sessions[prefix.owner].tenant_salt, session_id=prefix.owner[1])
        cid = f"group-{'prefetch' if fetch else 'retain'}-{prefix.worker}-{blocks[-1].hex()[:32]}-{int(until)}"
        return WorkerCommand(worker=prefix.worker, command_id=cid, command=cmd)

    def _demote_unshared(self, session: TrackedSession) -> list[WorkerCommand]:
        if not session.worker:
            return []
        in_l1 = self.view.workers.get(session.worker)
        held = in_l1.tiers[Tier.L1] if in_l1 is not None else set()
        shared = self.groups.kept_for_children(session.key, self.sessions)  # its children read that run
        mine = [h for h in reversed(session.chain[shared:]) if self.claims.get(h, 0) <= 1 and h in held]
        if not mine:
            return []
        self.counts.ended_demoted += len(mine)
        cid = f"ended-{session.worker}-{session.chain[-1].hex()[:32]}"
        return [WorkerCommand(worker=session.worker, command_id=cid,
                              command=Demote(hashes=[h.hex() for h in mine], src=Tier.L1))]
