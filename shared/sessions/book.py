"""The session book: which session each block belongs to, and when that session next needs it.

An eviction policy asks ``next_use(block, last_access)``: the time at which
the block is expected to be read again, Belady's key estimated online. A
block belongs to the latest session whose turn sent it. Per session:

- during a turn (started, not ended): the turn's start, i.e. now: in use.
  A turn starts when it is admitted (`turn_announced`) or when its blocks
  arrive (`turn_started`), whichever comes first; the second only binds
  the blocks;
- after a turn that ended with tools or an answer: ``Outlook.next_use()``
  from the ``ReturnPredictor``, the time until its return stretched by the
  odds that it returns at all (expected reads per second a block is kept);
- while it stays away, re-estimated at its outlook's checkpoints (the gap
  window's quantiles) as ``Outlook.given_absent(checkpoint)``: an idle
  session whose gaps are heavy-tailed drifts away, one whose tool has a
  steady latency draws nearer until it is overdue;
- a session that said it ended: never (inf).

A block several sessions sent (a shared system prompt) follows its latest
session, except that it outlives that session's end: an ended session's
*unshared* blocks go first, and so do the blocks a session's new turn no
longer sends (its context was rewritten, or the block was the ragged end of
the previous prompt, now filled with the answer). An unknown block gets the prior of a first
answer turn that ended at its last access.

Forked sessions (a sub-agent and the session it was forked from: `link`)
form a group. A block one member sent and another sends again stays with
both (up to `_MAX_KEEPERS` earlier members keep it), and is needed at the
earliest of their next uses: the prefix a sub-agent shares with its parent
is kept for the parent waiting on it, after the sub-agent's last answer.

The next use of a session changes only at its turn events and at its
deadline; the blocks whose key moved are collected for ``take_changed`` so
a lazy-heap cache can re-key them (``PolicyCache.rekey``). Bounded (blocks,
sessions: LRU). Not thread-safe.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.lru import BoundedLRU
from kvmesh.sessions.events import TurnOutcome
from kvmesh.sessions.predict import Outlook, ReturnPredictor
from kvmesh.sessions.inference_trust import InferenceTrust

_NOBODY = ""  # the owner of a block its session no longer sends


@dataclass(frozen=True, slots=True)
class BookConfig:
    max_blocks: int = 1 << 19
    max_sessions: int = 1 << 16
    # collect re-key sets for a lazy-heap cache; off for a caller that ranks afresh each time (the Advisor)
    track_changes: bool = True


_MAX_KEEPERS = 8  # earlier members of the owner's group that still hold a block
_MAX_GROUP_DEPTH = 16  # parent links followed to find a group's root


@dataclass(slots=True)
class _Block:
    session: str  # the latest session that sent it
    shared: bool  # sent by more than one session
    keepers: tuple[str, ...] = ()  # earlier senders in `session`'s group that still hold it (latest first)


@dataclass(slots=True)
class _Session:
    blocks: dict[bytes, None] = field(default_factory=dict)  # insertion-ordered set
    # a time (in a turn: in use since then; inf: ended), an Outlook (away), None (nothing known: the prior)
    state: float | Outlook | None = None
    version: int = 0  # bumped by every turn event: stale checkpoints are ignored
    explicit: bool = False  # the client named it (an id it sent), rather than the server inferring it
    parent: str | None = None  # the session it was forked from (`link`)


class SessionBook:
    """Blocks -> sessions -> expected next use; fed by turn events, read by policies."""

    def __init__(self, predictor: ReturnPredictor | None = None, config: BookConfig | None = None) -> None:
        self.predictor = predictor if predictor is not None else ReturnPredictor()
        self.config = config or BookConfig()
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._sessions: BoundedLRU[str, _Session] = BoundedLRU(self.config.max_sessions)
        self._checkpoints: list[tuple[float, int, str, int]] = []
        self._changed: set[bytes] = set()
        self._seq = 0
        self.inference = InferenceTrust()  # whether the server-inferred sessions describe the traffic

    # -- turn events ----------------------------------------------------------

    def turn_started(self, session_id: str, hashes: Sequence[bytes], at: float,
                     explicit: bool = False) -> float | None:
        """A turn of ``session_id`` that sends ``hashes`` arrived; returns the prediction error (s) or None.
        ``explicit``: the client named the session (once named, it stays explicit).

        If the session is already in a turn (announced at admission: `turn_announced`), this is that
        turn's job arriving: only its blocks are bound, the predictor learnt the gap already."""
        return self._turn(session_id, hashes, at, explicit, observe=True)

    def turn_announced(self, session_id: str, at: float, explicit: bool = False) -> float | None:
        """A turn of ``session_id`` was admitted at ``at``, its blocks not known yet: the session is in use
        from now on (its blocks are the ones it sent before). Returns the prediction error, as `turn_started`."""
        return self._turn(session_id, self.blocks_of(session_id), at, explicit, observe=False)

    def _turn(self, session_id: str, hashes: Sequence[bytes], at: float, explicit: bool,
              observe: bool) -> float | None:
        """`observe`: `hashes` are the turn's own (not the blocks it sent before), so they show how much
        of the session the turn sends again."""
        self.advance(at)
        known = session_id in self._sessions
        s = self._session(session_id)
        if explicit and not s.explicit:
            s.explicit = True  # named now (the job may arrive before the event that says so): re-rank its blocks
            if self.config.track_changes:
                self._changed.update(s.blocks)
        if isinstance(s.state, float) and s.state < math.inf:
            self._drop_unsent(session_id, s, hashes, observe=observe and not s.explicit)
            self.bind(session_id, hashes, at)
            return None
        if not s.explicit:
            self.inference.turn(known)
        error = self.predictor.turn_started(session_id, at)
        self._drop_unsent(session_id, s, hashes, observe=observe and not s.explicit)
        self.bind(session_id, hashes, at)
        self._set(s, at)
        return error

    def turn_ended(self, session_id: str, at: float, outcome: TurnOutcome, tools: Sequence[str] = (),
                   hint_s: float | None = None, hashes: Sequence[bytes] = (), now: float | None = None) -> None:
        """The turn ended (``hashes``: blocks it produced, if the caller knows them beyond the prompt).

        ``now``: the clock, when the end is reported ahead of its stamp ``at`` (a replay that knows
        the decode time); other sessions' checkpoints are then only advanced to ``now``.
        """
        self.advance(at if now is None else min(now, at))
        self.predictor.turn_ended(session_id, at, outcome, tools, hint_s, now=now)
        s = self._session(session_id)
        if hashes:
            self.bind(session_id, hashes, at)
        o = self.predictor.outlook(session_id)
        if o is None or o.outcome is TurnOutcome.ENDED:
            self._set(s, math.inf)
            return
        self._set(s, o)
        for t in o.checkpoints():
            self._seq += 1
            heapq.heappush(self._checkpoints, (t, self._seq, session_id, s.version))

    def link(self, child: str, parent: str) -> None:
        """``child`` was forked from ``parent`` (a sub-agent): they are one group from now on. A link
        that would close a cycle is ignored; a newer link replaces an older one."""
        if child == parent or self._root(parent) == child:
            return
        self._session(child).parent = parent

    def bind(self, session_id: str, hashes: Iterable[bytes], at: float) -> None:
        """``session_id`` sent ``hashes`` at ``at``: they are its blocks now (and still its group's
        earlier senders')."""
        s = self._session(session_id)
        for h in hashes:
            b = self._blocks.get(h)
            if b is None:
                b = self._blocks[h] = _Block(session_id, False)
                if len(self._blocks) > self.config.max_blocks:
                    old_h, old = self._blocks.popitem(last=False)
                    for holder in (old.session, *old.keepers):
                        self._release(holder, old_h)
            else:
                self._blocks.move_to_end(h)
                if b.session != session_id:
                    b.shared = True
                    self._hand_over(h, b, session_id)
            s.blocks[h] = None

    def advance(self, now: float) -> None:
        """Re-estimate the sessions still away at the checkpoints that passed by ``now``."""
        self.predictor.advance(now)
        while self._checkpoints and self._checkpoints[0][0] <= now:
            t, _, session_id, version = heapq.heappop(self._checkpoints)
            s = self._sessions.get(session_id)
            o = self.predictor.outlook(session_id)
            if s is None or s.version != version or o is None:
                continue  # a newer turn event superseded it
            self._set(s, o.given_absent(t), bump=False)

    # -- what policies read ---------------------------------------------------

    def next_use(self, block_hash: bytes, last_access: float) -> float:
        """Expected time of the block's next read (inf: not expected again), as of its session's latest
        event; for a block a group shares, the earliest of its holders'."""
        b = self._blocks.get(block_hash)
        if b is not None and b.session == _NOBODY:
            state: float | Outlook | None = math.inf  # its session moved on without it
        else:
            s = self._sessions.get(b.session) if b is not None else None
            state = s.state if s is not None else None
        if state is None or (state == math.inf and b is not None and b.shared):
            state = self.predictor.prior(last_access)  # unknown, or another session may want it
        t = state.next_use() if isinstance(state, Outlook) else state
        for keeper in b.keepers if b is not None else ():
            k = self._sessions.get(keeper)
            if k is not None and k.state is not None:
                t = min(t, k.state.next_use() if isinstance(k.state, Outlook) else k.state)
        return t

    def take_changed(self) -> set[bytes]:
        """Blocks whose next use moved since the last call (to re-key), and forget them."""
        changed, self._changed = self._changed, set()
        return changed

    def session_of(self, block_hash: bytes) -> str | None:
        """The latest session that sent the block and still does (None: unknown, or dropped by it)."""
        b = self._blocks.get(block_hash)
        return None if b is None or b.session == _NOBODY else b.session

    def named_by_client(self, session_id: str | None) -> bool:
        """Whether the client named the session (rather than the server inferring it)."""
        s = self._sessions.get(session_id) if session_id is not None else None
        return s is not None and s.explicit

    def blocks_of(self, session_id: str) -> list[bytes]:
        s = self._sessions.get(session_id)
        return [] if s is None else list(s.blocks)

    def outlook(self, session_id: str) -> Outlook | None:
        return self.predictor.outlook(session_id)

    def in_turn(self, session_id: str) -> bool:
        """Whether a turn of the session started (admitted or arrived) and has not ended."""
        s = self._sessions.get(session_id)
        return s is not None and isinstance(s.state, float) and s.state < math.inf

    # -- internals ------------------------------------------------------------

    def _session(self, session_id: str) -> _Session:
        return self._sessions.entry(session_id, _Session)

    def _drop_unsent(self, session_id: str, s: _Session, hashes: Sequence[bytes], observe: bool = False) -> None:
        """Blocks the session sent before but not in this turn (a rewritten context, a ragged end) are dead
        to it: to everyone if it owned them and no group member keeps them.
        `observe`: count the share sent again (a new turn of an inferred session)."""
        sent = set(hashes)
        dead = [h for h in s.blocks if h not in sent]
        if observe:
            self.inference.sent_again(len(s.blocks) - len(dead), len(s.blocks))
        for h in dead:
            del s.blocks[h]
            b = self._blocks.get(h)
            if b is not None:
                if b.session == session_id:
                    b.session, b.keepers = (b.keepers[0], b.keepers[1:]) if b.keepers else (_NOBODY, ())
                else:
                    b.keepers = tuple(k for k in b.keepers if k != session_id)
            if self.config.track_changes:
                self._changed.add(h)

    def _hand_over(self, h: bytes, b: _Block, session_id: str) -> None:
        """`session_id` sends `b`, which another session owns: it is the owner now. The earlier holders
        in the new owner's group keep it; the others let it go."""
        earlier = [k for k in (b.session, *b.keepers) if k != session_id and k != _NOBODY]
        root = self._root(session_id)
        keep = [k for k in earlier if self._root(k) == root]
        for k in earlier:
            if k not in keep:
                self._release(k, h)
        b.session, b.keepers = session_id, tuple(keep[:_MAX_KEEPERS])
        for k in keep[_MAX_KEEPERS:]:
            self._release(k, h)

    def _release(self, session_id: str, h: bytes) -> None:
        holder = self._sessions.get(session_id)
        if holder is not None:
            holder.blocks.pop(h, None)

    def _root(self, session_id: str) -> str:
        """The first session of `session_id`'s group (itself if it has no known parent)."""
        for _ in range(_MAX_GROUP_DEPTH):
            s = self._sessions.get(session_id)
            if s is None or s.parent is None:
                break
            session_id = s.parent
        return session_id

    def _set(self, s: _Session, state: float | Outlook, bump: bool = True) -> None:
        if bump:
            s.version += 1
        if s.state != state:
            s.state = state
            if self.config.track_changes:
                self._changed.update(s.blocks)
