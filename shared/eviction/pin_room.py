"""A worker's session pin budget: what the retention planner holds on it, and how much of a chain still fits.

The budget is `pin_fraction` of the worker's L1, as its heartbeat states it
(the service's setting if it did not). Against it count, as distinct blocks
(what sessions share, a system prompt, counts once):

- every pin the planner granted there, until it lapses: a worker's pin only
  extends, never shrinks, so a pin granted earlier holds its blocks until
  its own deadline, whoever is expected back first. The shared prefixes
  pinned for forked groups (shared/eviction/session_groups.py) count too;
- the chains of the sessions whose turn was admitted on that worker (within
  the pin horizon: a lost end event stops counting then), pinned or not:
  their prefills need that room now.

Two counts bind: the pins alone, and the pins with the chains being
prefilled. A block already pinned costs neither; one a chain being
prefilled holds costs only the first (were it free, pins sharing a system
prompt with queued turns could pass the budget); any other costs both. So
the pins on a worker never pass the budget, nor do they with the chains
being prefilled unless those alone do. A chain longer than the room is
pinned in part: its leading blocks are what the next turn reuses first,
and a prefix pinned saves its recompute even when the tail is not (as the
engine's pin ledger does).

Pins need not leave room for the worker's largest next prompt: when it does
not fit and nothing else can run, the worker unpins idle blocks
(`PinSet.yield_idle`), so a pin can hold a prefill back only while others
run, never stall it. (Reserving that room refused nearly every pin on an L1
that a few long chains fill: 169 of 172 in `bench agents` at 1,536 blocks.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kvmesh.config import SessionRetentionSettings
from kvmesh.eviction.occupancy import OccupancyView
from kvmesh.eviction.session_groups import Key, SessionGroups
from kvmesh.protocol.blocks import Tier


class Holder(Protocol):
    """What the budget reads of a tracked session (shared/eviction/sessions.py `TrackedSession`)."""

    worker: str
    chain: list[bytes]
    started_request: str  # a turn admitted and not ended
    expected_at: float  # for a turn in flight: when it was admitted
    pinned_until: float
    pinned_len: int


@dataclass(slots=True)
class PinRoom:
    """Reads the planner's live `sessions` and `groups` (it owns them)."""

    view: OccupancyView
    settings: SessionRetentionSettings
    l1_default: int  # a worker's L1 when its heartbeat states none
    sessions: Mapping[Key, Holder]
    groups: SessionGroups

    def budget(self, worker: str) -> int:
        return int(self.settings.pin_fraction * (self.view.capacity(worker, Tier.L1, self.l1_default) or 0))

    def pinned(self, worker: str, now: float) -> int:
        """Distinct blocks the planner has pinned on `worker`."""
        return len(set().union(*(s.chain[:s.pinned_len] for s in self.sessions.values()
                                 if s.worker == worker and s.pinned_until > now),
                               *self.groups.pinned(worker, now)))

    def room(self, worker: str, chain: list[bytes], now: float, skip: Holder | None = None) -> int:
        """How many leading blocks of `chain` fit `worker`'s budget beside what it holds for others
        (`skip`: the session whose chain it is; its own earlier pin is being replaced)."""
        horizon = self.settings.pin_horizon_s
        pinned: set[bytes] = set()
        admitted: set[bytes] = set()
        for s in self.sessions.values():
            if s.worker != worker or s is skip:
                continue
            if s.pinned_until > now:
                pinned.update(s.chain[:s.pinned_len])
            if s.started_request and now < s.expected_at + horizon:
                admitted.update(s.chain)  # its prefill needs all of it
        pinned.update(*self.groups.pinned(worker, now))
        budget, n = self.budget(worker), 0
        free_pins, free_all = budget - len(pinned), budget - len(pinned | admitted)
        for h in chain:
            if h not in pinned:
                if free_pins <= 0 or (h not in admitted and free_all <= 0):
                    break
                free_pins -= 1
                free_all -= h not in admitted
            n += 1
        return n

    def covered(self, worker: str, last: bytes, until: float) -> bool:
        """Whether a pin on `worker` holds `last` (and so the chain it ends) until `until` or later."""
        return self.groups.covers(worker, last, until) or any(
            s.worker == worker and s.pinned_until >= until and last in s.chain[:s.pinned_len]
            for s in self.sessions.values())
