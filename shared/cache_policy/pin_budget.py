"""A pool's budget for session TTL pins: never more than ``limit`` blocks pinned at once.

A pinned block cannot be evicted, so pins are memory taken away from the
policy; unbounded, the sessions of one tenant in long tool calls could pin
a whole worker and starve everyone else. The budget counts distinct pinned
blocks until their pins expire (a pin only extends; extending a counted
block is free), and one session may take at most ``session_share`` of it.
Grants go to a chain's leading blocks first: a pinned prefix is a prefix
hit when the session returns, a pinned tail without its prefix is not.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

# Share of a pool that session pins may hold. A pin overrides the ranking,
# which already keeps sessions expected back soon; pins are the guarantee
# for the few sessions closest to returning (those mid tool call) against a
# burst of new prompts, and the rest of the pool must hold the prompts being
# prefilled (their blocks cannot go while they run) and what the ranking
# keeps. A tenth: on the agent trace it matches no pins within 0.2 points
# from 3 % to 30 % of the unique blocks and gains where L1 is smallest;
# a quarter costs up to 0.9 points and a half up to 2.3 at 4-10 % (docs/agent-sessions.md).
DEFAULT_PIN_FRACTION = 0.1
DEFAULT_SESSION_SHARE = 0.25  # of the budget: one session never pins more than a quarter of it


class PinBudget:
    """Pins of one pool: ``grant`` what fits, ``used(now)`` is what is pinned at ``now``."""

    def __init__(self, limit: int, session_share: float = DEFAULT_SESSION_SHARE) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        if not 0.0 < session_share <= 1.0:
            raise ValueError(f"session_share must be in (0, 1], got {session_share}")
        self.limit = limit
        self.per_session = max(1, int(limit * session_share)) if limit else 0
        self._until: dict[bytes, float] = {}
        self._expiry: list[tuple[float, bytes]] = []

    @classmethod
    def for_pool(cls, capacity: int, fraction: float = DEFAULT_PIN_FRACTION,
                 session_share: float = DEFAULT_SESSION_SHARE) -> PinBudget:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        return cls(int(capacity * fraction), session_share)

    def used(self, now: float) -> int:
        self._expire(now)
        return len(self._until)

    def grant(self, hashes: Sequence[bytes], until: float, now: float) -> list[bytes]:
        """The leading ``hashes`` (at most one session's share) that may be pinned until ``until``."""
        self._expire(now)
        if until <= now:
            return []
        granted: list[bytes] = []
        for h in hashes[: self.per_session]:
            held = self._until.get(h)
            if held is None:
                if len(self._until) >= self.limit:
                    break
                self._until[h] = until
                heapq.heappush(self._expiry, (until, h))
            elif until > held:
                self._until[h] = until
                heapq.heappush(self._expiry, (until, h))
            granted.append(h)
        return granted

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            until, h = heapq.heappop(self._expiry)
            if self._until.get(h) == until:
                del self._until[h]
