"""A Continuum-style baseline: LRU, plus a fixed TTL pin on a session's KV while its tool runs.

After a turn that ended with tool calls, the session's blocks are pinned
for ``ttl_s``; nothing predicts the tool's latency and nothing bounds the
pins but the pool itself (when everything is pinned, new blocks are not
cached). It is the "pin while the tool runs" idea of Continuum (multi-turn
agent scheduling with KV time-to-live) reduced to its policy, for
comparison with the session-aware default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.cache_policy.base import BlockInfo
from kvmesh.sessions.book import SessionBook
from kvmesh.sessions.events import TurnOutcome

# A TTL one would configure by hand: long enough for most tool runs
# (seconds), short enough not to hold memory through a person's reply.
DEFAULT_TTL_S = 30.0


@dataclass(slots=True)
class ContinuumPolicy:
    name = "continuum"
    ttl_s: float = DEFAULT_TTL_S
    book: SessionBook = field(default_factory=SessionBook)
    pin_fraction: float = 1.0  # no budget

    def priority(self, info: BlockInfo, now: float) -> float:
        return info.last_access

    def admit(self, info: BlockInfo, now: float) -> bool:
        return True

    def pin_after_turn(self, session_id: str, now: float) -> float | None:
        o = self.book.outlook(session_id)
        if o is None or o.outcome is not TurnOutcome.TOOL_CALLS:
            return None
        return now + self.ttl_s
