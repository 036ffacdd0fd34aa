"""The ingress's memory of sessions: which session a new request's chain continues, and each one's last turn.

Inference rule: a request without an explicit session id continues the
session whose *last* turn it extends. A finished turn leaves two anchors,
each a token sequence the next turn's prompt starts with when the
conversation goes on:
- the turn's prompt (a re-rendered history always starts with it), and
- the prompt plus the answer's ids (what the next prompt holds when the chat
  template re-renders the answer as generated; the prompt builder splices the
  generated ids back in, shared/ingress/core/prompt.py).
An anchor is stored as (hash of its last full block, the tokens after that
block): the request continues the session if its chain holds that block and
the tokens after it start with the stored tail, so the whole earlier
sequence, not just a shared block, is a prefix of the request. The deepest
anchor in the request's chain wins (the longest match), then the longest
tail, then the latest. Sequences shorter than a block anchor at the root.

Bounded: per tenant, `capacity` sessions (least recently active forgotten
first) with the anchors of their last turn only. Per process: another
ingress replica does not see these anchors (an explicit id works everywhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.lru import BoundedLRU
from kvmesh.sessions.events import TurnOutcome
from kvmesh.sessions.identity import SessionRef
from kvmesh.sessions.lineage import ParentRef
from kvmesh.sessions.outcome import Chain

ROOT = b""  # the anchor of a sequence shorter than one block
AnchorKey = tuple[bytes, tuple[int, ...]]  # (last full block hash or ROOT, the tokens after it)


@dataclass(slots=True)
class SessionRecord:
    """What the ingress knows of a session's last turn."""

    ref: SessionRef
    last_request_id: str = ""
    chain: Chain = field(default_factory=Chain)
    published: TurnOutcome | None = None  # how its last turn was published
    anchors: list[AnchorKey] = field(default_factory=list)
    ended: bool = False  # kept (without anchors) so a repeated end names the same chain
    # Forks (shared/ingress/sessions/forks.py): the parent, the group's root ("": itself), the length in
    # tokens of the first prompt this process saw of it, and how far its chain is in the fork index.
    parent: ParentRef | None = None
    root: str = ""
    first_tokens: int | None = None
    indexed: tuple[int, bytes] = (0, b"")  # (leading blocks indexed, the last of them)


def anchor_of(ids: Sequence[int], hashes: Sequence[bytes], block_size: int) -> AnchorKey:
    """The anchor of `ids`, given the hashes of its full blocks."""
    return (hashes[-1] if hashes else ROOT), tuple(ids[len(hashes) * block_size:])


@dataclass(slots=True)
class _Tenant:
    records: BoundedLRU[str, SessionRecord]  # client id -> record
    anchors: dict[bytes, dict[tuple[int, ...], str]] = field(default_factory=dict)  # block -> tail -> client id


class SessionTable:
    """See the module docstring. Not thread-safe: the ingress's event loop owns it."""

    def __init__(self, block_size: int, capacity: int = 4096) -> None:
        self.block_size, self.capacity = block_size, capacity
        self._tenants: dict[str, _Tenant] = {}  # tenants are authenticated ones: bounded by the key ring

    def __len__(self) -> int:
        return sum(len(t.records) for t in self._tenants.values())

    def get(self, tenant: str, client_id: str) -> SessionRecord | None:
        t = self._tenants.get(tenant)
        return t.records.get(client_id) if t is not None else None

    def find(self, tenant: str, prompt_ids: Sequence[int], hashes: Sequence[bytes]) -> SessionRecord | None:
        """The session whose last turn `prompt_ids` (full-block `hashes`) extends, by the module's rule."""
        t = self._tenants.get(tenant)
        if t is None:
            return None
        b = self.block_size
        for depth in range(len(hashes), -1, -1):
            tails = t.anchors.get(hashes[depth - 1] if depth else ROOT)
            if not tails:
                continue
            start = depth * b
            for tail, client_id in sorted(tails.items(), key=lambda kv: -len(kv[0])):
                if tuple(prompt_ids[start:start + len(tail)]) == tail and client_id in t.records:
                    return t.records.get(client_id)
        return None

    def record(self, ref: SessionRef) -> SessionRecord:
        """The record of `ref`'s session (created if new), now the most recently active."""
        t = self._tenant(ref.tenant)
        rec = t.records.get(ref.client_id) or SessionRecord(ref)
        for _, old in t.records.put(ref.client_id, rec):
            self._drop_anchors(t, old)
        return rec

    def turn_ended(self, rec: SessionRecord, anchors: Sequence[AnchorKey]) -> None:
        """`rec`'s last turn is now the one whose anchors are given (the previous turn's are dropped)."""
        t = self._tenant(rec.ref.tenant)
        self._drop_anchors(t, rec)
        for block, tail in anchors:
            tails = t.anchors.setdefault(block, {})
            tails.pop(tail, None)  # re-inserted last: the latest session holding an equal anchor wins
            tails[tail] = rec.ref.client_id
            rec.anchors.append((block, tail))

    def end(self, tenant: str, client_id: str) -> SessionRecord | None:
        """Mark a session ended and drop its anchors: a request extending its chain starts a new session
        (one naming it explicitly starts it again). None if this process does not know it."""
        t = self._tenants.get(tenant)
        rec = t.records.get(client_id) if t is not None else None
        if t is not None and rec is not None:
            self._drop_anchors(t, rec)
            rec.ended = True
        return rec

    def _tenant(self, tenant: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(BoundedLRU(self.capacity))
        return t

    @staticmethod
    def _drop_anchors(t: _Tenant, rec: SessionRecord) -> None:
        for block, tail in rec.anchors:
            tails = t.anchors.get(block)
            if tails is not None and tails.get(tail) == rec.ref.client_id:
                del tails[tail]
                if not tails:
                    del t.anchors[block]
        rec.anchors.clear()
