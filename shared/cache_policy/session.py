"""The session-aware policy: evict the block whose session is expected back last (Belady, predicted).

Offline Belady evicts the block used farthest in the future. Online, the
``SessionBook`` estimates that time per block from its session's turn
outcomes (a tool call: back in seconds; an answer: minutes, maybe never;
ended: never), so the priority is simply ``-next_use``: the session that
just went to think for minutes loses its tail first, a session whose tool
returns in two seconds keeps its blocks. Leaves go first (``PolicyCache``),
so an evicted session keeps its prefix longest, and what the pool evicts is
demoted, by the same order, to the next tier.

On top of the order, a session expected back soon (p_return >= ``min_p``,
deadline within ``pin_horizon_s``) is TTL-pinned until its deadline, within
the pool's ``PinBudget``: the guarantee that a burst of new prompts cannot
flush a session mid-tool-call, bounded so that pins cannot starve a worker.

Callers (``kvmesh sim``'s replay, the eviction service) drive the book with
turn events and apply pins; a lazy-heap cache re-keys ``book.take_changed()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvmesh.cache_policy.base import BlockInfo
from kvmesh.cache_policy.pin_budget import DEFAULT_PIN_FRACTION
from kvmesh.sessions.book import SessionBook


@runtime_checkable
class SessionAware(Protocol):
    """A policy that needs turn events: its ``book`` is fed by the caller, who also applies its pins."""

    book: SessionBook
    pin_fraction: float  # share of a pool its pins may hold (1.0: unbounded)

    def pin_after_turn(self, session_id: str, now: float) -> float | None:
        """Until when the session's blocks should be pinned after its turn ended at ``now`` (None: no pin)."""
        ...


@dataclass(frozen=True, slots=True)
class SessionParams:
    pin_fraction: float = DEFAULT_PIN_FRACTION
    # a pin is worth its memory for a session that is likely back (odds better than even) and soon:
    # tool runs take seconds to a couple of minutes; a person's reply takes longer and is not pinned.
    min_p: float = 0.5
    pin_horizon_s: float = 120.0


@dataclass(slots=True)
class SessionPolicy:
    name = "session"
    book: SessionBook = field(default_factory=SessionBook)
    params: SessionParams = field(default_factory=SessionParams)

    @property
    def pin_fraction(self) -> float:
        return self.params.pin_fraction

    def priority(self, info: BlockInfo, now: float) -> float:
        """Fixed between the session's events (its re-estimates are events): fits the lazy heap."""
        return -self.book.next_use(info.block_hash, info.last_access)

    def admit(self, info: BlockInfo, now: float) -> bool:
        return True

    def pin_after_turn(self, session_id: str, now: float) -> float | None:
        o = self.book.outlook(session_id)
        if o is None or not math.isfinite(o.deadline) or o.p_return < self.params.min_p:
            return None
        if o.deadline - now > self.params.pin_horizon_s:
            return None
        return o.deadline
