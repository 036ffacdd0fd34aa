"""The cache for queue-structured policies (S3-FIFO, ARC): the chain rules of ``PolicyCache``, the victim from queues.

Some policies are whole algorithms rather than priority functions: their
next victim depends on queue state that moves on every access (S3-FIFO's
small/main split, ARC's adaptive target), so no per-block key can stand in
for them under ``PolicyCache``'s lazy heap. Such a policy hands each cache
its own ``QueueAlgorithm`` (one per tier: queues are state of one cache), and
a ``QueueCache`` keeps the rules every policy obeys:

- capacity is never exceeded; a block that finds no room is not cached, and
  neither is the rest of its chain;
- the algorithm may only take a block that may go now: a leaf (no cached
  children), not pinned, not part of the request being inserted. Its
  victim is the first block, in its own order, that may go; one that may
  not keeps its place (as ``PolicyCache`` ranks leaves only, and a parent
  that becomes a leaf ranks by its own old access). So the cached blocks of
  a request's chain are always its leading ones, and a block is cached
  exactly when a prefix lookup can reach it: the algorithm's hits and the
  sim's prefix hits are the same blocks.

A request reads its whole chain at once. The algorithm sees its blocks in
chain order (it decides room block by block), then ``end_request`` lets it
break the tie among them leaf-first: a request's deepest block ranks as its
oldest, so the eviction end of a queue meets leaves before their parents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvmesh.cache_policy.base import BlockInfo
from kvmesh.cache_policy.policy_cache import BlockSpec, InsertResult

MayGo = Callable[[bytes], bool]  # whether a resident block may be evicted now


@dataclass(slots=True, frozen=True)
class Admission:
    """What ``QueueAlgorithm.insert`` did with a block that was not resident."""

    cached: bool
    evicted: bytes | None = None  # the block it displaced, if the cache was full


class QueueAlgorithm(Protocol):
    """One cache's queues: it knows its capacity and which blocks are resident, nothing of chains."""

    def __len__(self) -> int:
        """Resident blocks."""
        ...

    def read(self, block: bytes) -> None:
        """A resident block was read."""
        ...

    def insert(self, block: bytes, may_go: MayGo) -> Admission:
        """Make ``block`` resident, evicting one block that ``may_go`` if full; not cached if none may."""
        ...

    def discard(self, block: bytes) -> None:
        """A resident block leaves without being evicted (promoted to a higher tier): no ghost is kept."""
        ...

    def end_request(self) -> None:
        """The blocks read or inserted since the last call were one request, in chain order."""
        ...


@runtime_checkable
class QueuePolicy(Protocol):
    """A named queue-structured policy: fresh queues for each cache it runs."""

    name: str

    def queues(self, capacity: int) -> QueueAlgorithm: ...


class QueueCache:
    """Prefix-chained block cache of fixed capacity (in blocks) whose victims a ``QueueAlgorithm`` picks.

    It offers what the sim's tiers use of ``PolicyCache``: ``insert`` a
    request (L1), and ``adopt`` / ``touch`` / ``remove`` single blocks (L2,
    where a chain may start below its top, as in ``PolicyCache``).
    """

    def __init__(self, policy: QueuePolicy, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.policy = policy
        self.capacity = capacity
        self.queues = policy.queues(capacity)
        self.blocks: dict[bytes, BlockInfo] = {}
        self._waiting: dict[bytes, int] = {}  # parent not cached here -> cached blocks below it

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
        """Read a request's cached prefix and cache the rest of its chain in order, as room allows."""
        hashes = [s.block_hash for s in specs]
        hit = self.match_prefix(hashes)
        result = InsertResult(hit_blocks=hit, inserted=0)
        for spec in specs[:hit]:
            self._read(self.blocks[spec.block_hash], now, spec.pinned_until)
        protected = set(hashes)
        parent = hashes[hit - 1] if hit else None
        for depth in range(hit, len(specs)):
            spec = specs[depth]
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
            # a chain repeating a hash is malformed: it stops there
            if spec.block_hash in self.blocks or not self._place(info, now, protected, result):
                result.rejected = len(specs) - depth
                break
            result.inserted += 1
            parent = spec.block_hash
        self.queues.end_request()
        return result

    def touch(self, block_hash: bytes, now: float) -> bool:
        """A read of a cached block outside ``insert`` (a lower tier serving a request); False if not cached."""
        info = self.blocks.get(block_hash)
        if info is None:
            return False
        self._read(info, now, 0.0)
        self.queues.end_request()
        return True

    def adopt(self, info: BlockInfo, now: float) -> InsertResult:
        """Take one block from a higher tier, with its statistics; the algorithm admits it like a miss."""
        result = InsertResult(hit_blocks=0, inserted=0)
        held = self.blocks.get(info.block_hash)
        if held is not None:
            held.last_access = max(held.last_access, info.last_access)
            result.hit_blocks = 1
            return result
        info.num_children = 0
        info.pinned_until = 0.0
        if self._place(info, now, set(), result):
            result.inserted = 1
        else:
            result.rejected = 1
        self.queues.end_request()
        return result

    def remove(self, block_hash: bytes, now: float) -> BlockInfo | None:
        """Take a block out (promoted to a higher tier), leaf or not: its cached children become roots."""
        if block_hash not in self.blocks:
            return None
        self.queues.discard(block_hash)
        return self._unlink(block_hash)

    def rekey(self, hashes: Iterable[bytes], now: float) -> None:
        """Nothing to do: a queue's order moves only on the algorithm's own events."""

    # -- internals -------------------------------------------------------

    def _read(self, info: BlockInfo, now: float, pinned_until: float) -> None:
        info.last_access = now
        info.access_count += 1
        info.pinned_until = max(info.pinned_until, pinned_until)
        self.queues.read(info.block_hash)

    def _place(self, info: BlockInfo, now: float, protected: set[bytes], result: InsertResult) -> bool:
        def may_go(h: bytes) -> bool:
            held = self.blocks[h]
            return held.num_children == 0 and held.pinned_until <= now and h not in protected

        admission = self.queues.insert(info.block_hash, may_go)
        if not admission.cached:
            return False
        if admission.evicted is not None:
            victim = self._unlink(admission.evicted)
            result.evicted.append(victim.block_hash)
            result.evicted_blocks.append(victim)
        self._link(info)
        return True

    def _link(self, info: BlockInfo) -> None:
        h = info.block_hash
        self.blocks[h] = info
        info.num_children = self._waiting.pop(h, 0)  # roots below it (a lower tier): linked now
        parent = info.parent_hash
        if parent is None:
            return
        if parent in self.blocks:
            self.blocks[parent].num_children += 1
        else:
            self._waiting[parent] = self._waiting.get(parent, 0) + 1

    def _unlink(self, block_hash: bytes) -> BlockInfo:
        info = self.blocks.pop(block_hash)
        if info.num_children:  # removed with children (promotion): they wait for it as roots
            self._waiting[block_hash] = info.num_children
            info.num_children = 0
        parent = info.parent_hash
        if parent is None:
            return info
        if parent in self.blocks:
            self.blocks[parent].num_children -= 1
        else:
            left = self._waiting[parent] - 1
            if left:
                self._waiting[parent] = left
            else:
                del self._waiting[parent]
        return info
