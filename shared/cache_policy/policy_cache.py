"""The one cache mechanism every policy runs under: capacity, leaf-first, pins, admission.

A ``PolicyCache`` holds chained blocks (each block's parent is the block
before it in a prompt) up to ``capacity`` blocks and asks its policy only
two questions: a block's ``priority`` (lowest evicted first) and whether a
new block is ``admit``-ted. The rules no policy may break live here:

- capacity is never exceeded: a block that finds no room is not cached, and
  neither is the rest of its chain (a child without its parent is unreachable);
- only leaves are evicted (a block with cached children stays), so a block
  ``insert`` cached has its parent cached; in a lower tier, fed by ``adopt``,
  a chain may start below its top (the parent lives in a higher tier): such a
  block is a root until its parent arrives, then it is linked under it;
- ``num_children`` counts exactly the cached blocks whose parent is the block;
- a block pinned into the future (``pinned_until > now``) is never evicted;
- blocks of the request being inserted are never evicted while it inserts.

A policy that is also an ``AccessObserver`` hears of every block of every
request (hit or miss) before it is asked about them; one that is also a
``DisplacementGate`` is asked ``may_displace`` before a new block evicts.

Eviction is a heap of leaves with lazy deletion. A key is computed when a
block becomes a leaf or is touched, so a policy's priority must keep its
*order* between two events on a block (true for last-access, counts, and
decayed scores written as ``log f + t / tau``); a policy whose keys move on
other events (a session's turn ended) has the caller ``rekey`` those blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.cache_policy.base import (
    AccessObserver,
    BlockInfo,
    DisplacementGate,
    EvictionPolicy,
)


@dataclass(slots=True)
class BlockSpec:
    """What the caller knows about a block it wants cached."""

    block_hash: bytes
    num_tokens: int = 512
    size_bytes: int = 1
    pinned_until: float = 0.0


@dataclass(slots=True)
class InsertResult:
    """Outcome of ``PolicyCache.insert`` for one request."""

    hit_blocks: int  # leading blocks that were already cached (prefix hit)
    inserted: int  # blocks newly cached
    evicted: list[bytes] = field(default_factory=list)
    evicted_blocks: list[BlockInfo] = field(default_factory=list)  # the same, with their stats (to demote)
    rejected: int = 0  # blocks not cached: refused by admission or no evictable room


class PolicyCache:
    """Prefix-chained block cache of fixed capacity (in blocks) driven by one policy."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.policy = policy
        self.capacity = capacity
        self.blocks: dict[bytes, BlockInfo] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        self._live: dict[bytes, int] = {}  # leaf -> seq of its valid heap entry
        self._pins: list[tuple[float, bytes]] = []  # (pinned_until, hash) parked leaves
        self._children: dict[bytes, set[bytes]] = {}  # cached parent -> its cached children
        self._orphans: dict[bytes, set[bytes]] = {}  # parent not cached here -> cached roots below it
        self._seq = 0
        self._observe = policy.on_access if isinstance(policy, AccessObserver) else None
        self._gate = policy.may_displace if isinstance(policy, DisplacementGate) else None

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks

    def match_prefix(self, hashes: Sequence[bytes]) -> int:
        """Number of leading ``hashes`` that are cached; reads only, touches nothing."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, specs: Sequence[BlockSpec], now: float) -> InsertResult:
        """Look up a request's chain, touch its cached prefix and cache the rest.

        Blocks past the first miss are new to this cache (a cached block's
        parent is always cached), so they are admitted and inserted in
        order until one is refused or finds no room.
        """
        hit = self.match_prefix([s.block_hash for s in specs])
        protected = {s.block_hash for s in specs}
        if self._observe is not None:
            for spec in specs:
                self._observe(spec.block_hash, now)
        result = InsertResult(hit_blocks=hit, inserted=0)
        for spec in specs[:hit]:
            self._touch(self.blocks[spec.block_hash], spec, now)
        parent = specs[hit - 1].block_hash if hit else None
        for depth in range(hit, len(specs)):
            spec = specs[depth]
            if spec.block_hash in self.blocks:  # a chain repeating a hash is malformed: stop
                result.rejected = len(specs) - depth
                break
            info = BlockInfo(
                block_hash=spec.block_hash,
                parent_hash=parent,
                depth=depth,
                num_tokens=spec.num_tokens,
                size_bytes=spec.size_bytes,
                created_at=now,
                last_access=now,
                pinned_until=spec.pinned_until,
            )
            if not self.policy.admit(info, now) or not self._make_room(info, now, protected, result):
                result.rejected = len(specs) - depth
                break
            self._add(info, now)
            result.inserted += 1
            parent = spec.block_hash
        return result

    def pin(self, block_hash: bytes, until: float) -> None:
        """Extend a block's TTL pin (never shortens it)."""
        info = self.blocks[block_hash]
        info.pinned_until = max(info.pinned_until, until)

    def touch(self, block_hash: bytes, now: float) -> bool:
        """A read of a cached block outside ``insert`` (a lower tier serving a request); False if not cached."""
        info = self.blocks.get(block_hash)
        if info is None:
            return False
        self._touch(info, BlockSpec(block_hash), now)
        return True

    def rekey(self, hashes: Iterable[bytes], now: float) -> None:
        """Recompute the eviction key of those ``hashes`` that are cached, unparked leaves."""
        for h in hashes:
            info = self.blocks.get(h)
            if info is not None and info.num_children == 0 and h in self._live:
                self._push(info, now)

    def adopt(self, info: BlockInfo, now: float) -> InsertResult:
        """Take one block from a higher tier, with its statistics; it stays out if it ranks below every victim.

        When full, the lowest-priority evictable leaf goes only if it ranks
        below ``info``; otherwise ``info`` is the one refused. Its pin and
        children count restart here. Already cached: touched.
        """
        result = InsertResult(hit_blocks=0, inserted=0)
        held = self.blocks.get(info.block_hash)
        if held is not None:
            held.last_access = max(held.last_access, info.last_access)
            if held.num_children == 0 and info.block_hash in self._live:
                self._push(held, now)
            result.hit_blocks = 1
            return result
        info.num_children = 0
        info.pinned_until = 0.0
        if not self.policy.admit(info, now) or not self._make_room(
                info, now, set(), result, rival=self.policy.priority(info, now)):
            result.rejected = 1
            return result
        self._add(info, now)
        result.inserted = 1
        return result

    def remove(self, block_hash: bytes, now: float) -> BlockInfo | None:
        """Take a block out (promoted to a higher tier), leaf or not: its cached children become roots."""
        info = self.blocks.get(block_hash)
        if info is None:
            return None
        kids = self._children.pop(block_hash, None)
        if kids:
            self._orphans.setdefault(block_hash, set()).update(kids)
        info.num_children = 0
        self._evict(info, now)
        return info

    def evictable(self, now: float) -> Iterable[BlockInfo]:
        """Blocks eviction may take now: unpinned leaves (for tests and tools)."""
        return (b for b in self.blocks.values() if b.num_children == 0 and b.pinned_until <= now)

    # -- internals -------------------------------------------------------

    def _touch(self, info: BlockInfo, spec: BlockSpec, now: float) -> None:
        info.last_access = now
        info.access_count += 1
        info.pinned_until = max(info.pinned_until, spec.pinned_until)
        if info.num_children == 0:
            self._push(info, now)

    def _add(self, info: BlockInfo, now: float) -> None:
        h = info.block_hash
        self.blocks[h] = info
        if info.parent_hash is not None:
            parent = self.blocks.get(info.parent_hash)
            if parent is None:  # adopted below its chain's top in this tier
                self._orphans.setdefault(info.parent_hash, set()).add(h)
            else:
                parent.num_children += 1
                self._children.setdefault(info.parent_hash, set()).add(h)
                self._live.pop(info.parent_hash, None)  # no longer a leaf
        below = self._orphans.pop(h, None)
        if below:  # roots that were waiting for this block: link them
            self._children[h] = below
            info.num_children = len(below)
        else:
            self._push(info, now)

    def _push(self, info: BlockInfo, now: float) -> None:
        self._seq += 1
        self._live[info.block_hash] = self._seq
        heapq.heappush(self._heap, (self.policy.priority(info, now), self._seq, info.block_hash))

    def _make_room(self, new: BlockInfo, now: float, protected: set[bytes], result: InsertResult,
                   rival: float | None = None) -> bool:
        """Evict a leaf so that ``new`` fits; False if nothing may go, the gate refuses ``new``, or every
        evictable leaf ranks at or above ``rival`` (``new``'s own priority, when given)."""
        if len(self.blocks) < self.capacity:
            return True
        if self._gate is not None and rival is None and not self._gate(new, now):
            return False
        self._release_pins(now)
        skipped: list[tuple[float, int, bytes]] = []
        victim = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            h = entry[2]
            if self._live.get(h) != entry[1]:
                continue  # stale: touched since, no longer a leaf, or evicted
            if h in protected:
                skipped.append(entry)
                continue
            info = self.blocks[h]
            if info.pinned_until > now:
                del self._live[h]
                heapq.heappush(self._pins, (info.pinned_until, h))
                continue
            if rival is not None and entry[0] >= rival:
                skipped.append(entry)
                break
            victim = info
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if victim is None:
            return False
        self._evict(victim, now)
        result.evicted.append(victim.block_hash)
        result.evicted_blocks.append(victim)
        return True

    def _evict(self, info: BlockInfo, now: float) -> None:
        h = info.block_hash
        del self.blocks[h]
        self._live.pop(h, None)
        if info.parent_hash is None:
            return
        parent = self.blocks.get(info.parent_hash)
        siblings = (self._children if parent is not None else self._orphans).get(info.parent_hash)
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del (self._children if parent is not None else self._orphans)[info.parent_hash]
        if parent is not None:
            parent.num_children -= 1
            if parent.num_children == 0:
                self._push(parent, now)

    def _release_pins(self, now: float) -> None:
        while self._pins and self._pins[0][0] <= now:
            _, h = heapq.heappop(self._pins)
            info = self.blocks.get(h)
            if info is not None and info.num_children == 0 and h not in self._live:
                if info.pinned_until <= now:
                    self._push(info, now)
                else:  # pin was extended while parked
                    heapq.heappush(self._pins, (info.pinned_until, h))
