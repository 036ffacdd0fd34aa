"""The default policy: the session's predicted return where the session vouches, else cost's order, new blocks last.

Two signals decide which block goes first, and neither is best on every trace
(docs/eviction-policy.md):

- **The session's return** (``SessionPolicy``): evict the block whose session
  is expected back last. On agent traffic, where a session leaves for a tool
  and comes back in seconds, this is close to Belady (0.85-0.9 of it) and up
  to 2.7x LRU.
- **Evidence of reuse** (the doorkeeper of ``CostPolicy``): a block requested
  only once is most likely a one-off tail. On traffic whose sessions the
  server can only infer (conversations without ids, Mooncake's trace), the
  inferred sessions do not predict which new blocks come back, and letting
  every new block compete with reused ones loses to a cache that makes new
  blocks earn their place.

So: a block whose session vouches for it ranks by that session's return;
any other ranks by ``cost``'s order (reuse x recompute cost, decaying with
idle time, in seconds), in a band below every vouched block, and, if it was
requested only once (``cost``'s ``AccessHistory``, which outlives
evictions), in a band below that, as cost's doorkeeper would refuse it. A
session vouches:
- when the client named it (an explicit id: ``SessionBook.named_by_client``):
  an agent's next turn reads the tail this turn wrote;
- when the server inferred it, while inferred sessions describe the traffic
  (``SessionBook.inference.trusted``: they come back, and their turns send
  their earlier blocks again; shared/sessions/inference_trust.py). On the
  SWE-agent trace without its ids they do, and the session order is worth up
  to 2.7x LRU there; on Mooncake's trace they rarely come back; on a
  generated agent trace whose sessions share a system prompt, inference
  merges them, and the session order, with its pins, falls below LRU.
Only a session that vouches is pinned after its turn (``pin_after_turn``).
Tables: docs/eviction-policy.md.

Tried and dropped: a finite penalty in place of "below every other block"
(no value served both Mooncake and agents), and trusting inferred sessions
by how often their new blocks were read again at all (Mooncake 73%, agents
62%: it did not separate them).

The priority is fixed between the block's accesses and its session's
events, as the lazy-heap caches need: an access re-keys the block (its
count moved), and session events re-key through ``book.take_changed()``.
When the inferred sessions' share crosses the line, a block already cached
is re-ranked at its next access or session event, not at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.cache_policy.base import BlockInfo
from kvmesh.cache_policy.cost import CostPolicy
from kvmesh.cache_policy.session import SessionPolicy

# Bands below every finite session rank (-next_use): blocks no session vouches for rank by cost's order,
# new ones (seen once) below reused ones. Ended sessions' blocks (-inf) still go first.
_REUSED = -1e15
_NEW = -2e15
# Requests a block needs (this one included) before it counts as reused, as cost's doorkeeper.
_PROVEN_REQUESTS = 2


@dataclass(slots=True)
class DefaultPolicy(SessionPolicy):
    name = "default"
    cost: CostPolicy = field(default_factory=CostPolicy)  # its history (of every access) is the doorkeeper's

    def on_access(self, block_hash: bytes, now: float) -> None:
        self.cost.on_access(block_hash, now)

    def vouches(self, session_id: str | None) -> bool:
        """Whether the session is worth ranking (and pinning) its blocks by: named by the client, or
        inferred while inferred sessions are trusted."""
        if session_id is None:
            return False
        return self.book.named_by_client(session_id) or self.book.inference.trusted

    def vouched(self, block_hash: bytes) -> bool:
        return self.vouches(self.book.session_of(block_hash))

    def pin_after_turn(self, session_id: str, now: float) -> float | None:
        """As `session`'s, for a session that vouches: a guessed session's pins would hold the wrong blocks."""
        return SessionPolicy.pin_after_turn(self, session_id, now) if self.vouches(session_id) else None

    def priority(self, info: BlockInfo, now: float) -> float:
        if self.vouched(info.block_hash):
            return SessionPolicy.priority(self, info, now)
        seen = max(self.cost.history.count(info.block_hash), info.access_count)  # history: across evictions
        band = _REUSED if seen >= _PROVEN_REQUESTS else _NEW
        return band + self.cost.params.tau_s * self.cost.priority(info, now)  # cost's order, in seconds
