"""Forked sessions in the eviction service: a root session, its sub-agents, and the prefix they share.

A session event names the session's parent when it was forked from one
(`SessionEvent.parent_session_id`). A group is a root and everything forked
from it, transitively. What a child shares with its parent is the common
leading run of their chains: the parent's context up to the fork. The
planner (shared/eviction/sessions.py) keeps that run on the parent's worker
(the group's home: routing sends the group there) while any member of the
group is active, and does not demote it first when the parent ends while a
child still runs.

A child whose first turn is in flight has no known chain yet (its started
event names the prompt's last block, which no worker has stored): it is
taken to share at most what its prompt could, `min(prompt blocks, parent's
chain)`. A sub-agent with a fresh context has a short prompt, so that bound
stays close; once its first turn ends the exact run replaces it.

The shared prefixes pinned for groups are kept here too, until they lapse
(a worker's pin cannot be taken back): the planner counts them in its
workers' pin budgets.

Bounded: links exist for tracked sessions only and go with them; a group is
read at most `MAX_MEMBERS` members deep per event and a root is at most
`MAX_DEPTH` links up (sub-agents of sub-agents rarely nest deeper). A link
that would close a cycle is not made.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

Key = tuple[str, str]  # (tenant, scoped session id)

MAX_MEMBERS = 64
MAX_DEPTH = 8


class Member(Protocol):
    """What a group reads of a tracked session (shared/eviction/sessions.py `TrackedSession`)."""

    worker: str
    chain: list[bytes]
    started_request: str  # a turn is in flight
    announced_blocks: int  # the prompt's full blocks its latest started event named


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The leading run of `owner`'s chain that its children share, on `owner`'s worker."""

    owner: Key
    worker: str
    blocks: list[bytes]  # root first


@dataclass(slots=True)
class GroupPin:
    """A shared prefix pinned on `worker` until `until` (a later pin of it only extends it)."""

    worker: str
    blocks: list[bytes]  # root first
    until: float


def common_run(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Length of the common leading run of two chains."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_blocks(child: Member, parent: Member) -> int:
    """How many leading blocks of `parent`'s chain `child` shares (see the module docstring)."""
    if child.chain:
        return common_run(child.chain, parent.chain)
    if child.started_request:
        return min(child.announced_blocks, len(parent.chain))
    return 0


class SessionGroups:
    """Parent links between tracked sessions, and the shared prefixes pinned for them until they lapse.
    Not thread-safe: the planner owns it."""

    def __init__(self) -> None:
        self.parent: dict[Key, Key] = {}
        self.children: dict[Key, set[Key]] = {}  # kept while a child links to it, tracked or not
        self.pins: dict[tuple[str, bytes], GroupPin] = {}  # (worker, last block) -> the pin

    def link(self, child: Key, parent: Key) -> None:
        """`child` was forked from `parent` (a newer link replaces an older one; a cycle is refused)."""
        if self.parent.get(child) == parent or parent == child or self.root(parent) == child:
            return
        self._unlink(child)
        self.parent[child] = parent
        self.children.setdefault(parent, set()).add(child)

    def forget(self, key: Key) -> None:
        """`key` is no longer tracked: its own link goes; its children keep theirs (they stay one group)."""
        self._unlink(key)

    def root(self, key: Key) -> Key:
        seen = {key}
        for _ in range(MAX_DEPTH):
            up = self.parent.get(key)
            if up is None or up in seen:
                break
            seen.add(up)
            key = up
        return key

    def members(self, key: Key) -> list[Key]:
        """`key`'s group, root first, breadth first, at most `MAX_MEMBERS` (the root may be untracked)."""
        out, i = [self.root(key)], 0
        seen = set(out)
        while i < len(out) and len(out) < MAX_MEMBERS:
            for child in sorted(self.children.get(out[i], ())):
                if child not in seen and len(out) < MAX_MEMBERS:
                    seen.add(child)
                    out.append(child)
            i += 1
        return out

    def kept_for_children(self, key: Key, sessions: Mapping[Key, Member]) -> int:
        """Leading blocks of `key`'s chain that its tracked children still share (`MAX_MEMBERS` of them read)."""
        me = sessions.get(key)
        if me is None:
            return 0
        children = islice(self.children.get(key, ()), MAX_MEMBERS)
        return max((shared_blocks(c, me) for k in children if (c := sessions.get(k)) is not None), default=0)

    def shared_prefixes(self, key: Key, sessions: Mapping[Key, Member]) -> list[SharedPrefix]:
        """For each tracked parent in `key`'s group: the run of its chain its tracked children share."""
        out = []
        for owner in self.members(key):
            parent = sessions.get(owner)
            if parent is None or not parent.worker or not parent.chain:
                continue
            n = self.kept_for_children(owner, sessions)
            if n:
                out.append(SharedPrefix(owner, parent.worker, parent.chain[:n]))
        return out

    # --- pins ------------------------------------------------------------------

    def pin(self, worker: str, blocks: list[bytes], until: float) -> list[bytes]:
        """Record `blocks` (a chain's leading run) pinned on `worker` until `until`; returns `blocks`."""
        old = self.pins.get((worker, blocks[-1]))
        self.pins[(worker, blocks[-1])] = GroupPin(worker, blocks, max(until, old.until if old else until))
        return blocks

    def pinned(self, worker: str, now: float) -> Iterator[list[bytes]]:
        """The runs pinned on `worker` that have not lapsed by `now`."""
        return (g.blocks for g in self.pins.values() if g.worker == worker and g.until > now)

    def covers(self, worker: str, last: bytes, until: float) -> bool:
        """Whether a group pin on `worker` holds `last` until `until` or later."""
        return any(g.worker == worker and g.until >= until and last in g.blocks for g in self.pins.values())

    def prune(self, now: float) -> None:
        """Forget the pins that lapsed (they are bounded by the events in the last pin horizon)."""
        self.pins = {k: g for k, g in self.pins.items() if g.until > now}

    def _unlink(self, child: Key) -> None:
        parent = self.parent.pop(child, None)
        if parent is None:
            return
        siblings = self.children.get(parent)
        if siblings is not None:
            siblings.discard(child)
            if not siblings:
                del self.children[parent]
