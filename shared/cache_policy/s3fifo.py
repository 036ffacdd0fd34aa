"""S3-FIFO (Yang et al., SOSP'23) as a reference policy: three FIFO queues, no per-access reordering.

New blocks enter a small FIFO (~10% of capacity); the main FIFO holds the
rest; a ghost FIFO remembers keys (no data) evicted from the small queue,
as many as the main queue's share. Each resident block has a 2-bit
frequency, capped at 3, raised by every read and nothing else.

- Room is made from the small queue while it holds at least its share,
  otherwise from the main queue (and from the other one if the first has
  nothing that may go).
- Small queue, oldest first: a block read since it came in moves to the
  main queue with its frequency cleared; one that was not is evicted and
  its key goes to the ghost.
- Main queue, oldest first: a block with frequency > 0 is put back at the
  new end with frequency - 1; one at 0 is evicted (no ghost).
- A missed block whose key is in the ghost goes straight to the main queue.

Prefix chains (see ``queue_cache``): the victim is the first block, in
the algorithm's own walk, that may go. One that may not (it has cached
children, is pinned, or belongs to the request in flight) keeps its place
at the old end and goes as soon as it may, while the walk goes on past it
(moving read blocks to main, turning the main clock). A request's new
blocks enter the small queue deepest first, so a fresh chain leaves it
leaf to root. But a FIFO keeps arrival order and a session's chain grows
at its end: its older turns' blocks (the parents) reach the main queue's
old end before its newer turns' blocks. When a session goes quiet, its
root side waits there for its tail to come round; on agent traces most
blocks the walk passes over are such parents.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvmesh.cache_policy.queue_cache import Admission, MayGo

MAX_FREQ = 3  # two bits
DEFAULT_SMALL_FRACTION = 0.1


class S3FIFO:
    """The queues of one cache of ``capacity`` blocks (oldest first in each ``OrderedDict``)."""

    def __init__(self, capacity: int, small_fraction: float = DEFAULT_SMALL_FRACTION) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small fraction must be in (0, 1), got {small_fraction}")
        self.capacity = capacity
        self.small_share = max(1, int(small_fraction * capacity)) if capacity else 0
        self.ghost_capacity = capacity - self.small_share  # as many keys as the main queue's share
        self.small: OrderedDict[bytes, int] = OrderedDict()  # block -> frequency
        self.main: OrderedDict[bytes, int] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self._fresh: list[bytes] = []  # inserted during the current request, in chain order

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def read(self, block: bytes) -> None:
        queue = self.small if block in self.small else self.main
        queue[block] = min(queue[block] + 1, MAX_FREQ)

    def insert(self, block: bytes, may_go: MayGo) -> Admission:
        victim = None
        if len(self) >= self.capacity:
            victim = self._evict(may_go)
            if victim is None:
                return Admission(cached=False)
        if block in self.ghost:
            del self.ghost[block]
            self.main[block] = 0
        else:
            self.small[block] = 0
        self._fresh.append(block)
        return Admission(cached=True, evicted=victim)

    def discard(self, block: bytes) -> None:
        if self.small.pop(block, None) is None:
            del self.main[block]

    def end_request(self) -> None:
        for block in reversed(self._fresh):  # the deepest goes in first: the oldest of the request
            if block in self.small:
                self.small.move_to_end(block)
            elif block in self.main:
                self.main.move_to_end(block)
        self._fresh.clear()

    def _evict(self, may_go: MayGo) -> bytes | None:
        if self.small and (len(self.small) >= self.small_share or not self.main):
            return self._evict_small(may_go) or self._evict_main(may_go)
        return self._evict_main(may_go) or self._evict_small(may_go)

    def _evict_small(self, may_go: MayGo) -> bytes | None:
        held: list[bytes] = []
        victim = None
        for _ in range(len(self.small)):  # each block leaves the old end once: a full pass
            block, freq = self.small.popitem(last=False)
            if freq > 0:
                self.main[block] = 0
            elif may_go(block):
                victim = block
                self.ghost[block] = None
                while len(self.ghost) > self.ghost_capacity:
                    self.ghost.popitem(last=False)
                break
            else:
                held.append(block)
        _put_back(self.small, held)
        return victim

    def _evict_main(self, may_go: MayGo) -> bytes | None:
        held: list[bytes] = []
        victim = None
        # the queue turns like a clock: after MAX_FREQ + 1 turns every block is at 0 and was asked
        for _ in range((MAX_FREQ + 1) * len(self.main)):
            if not self.main:  # every block is held
                break
            block, freq = self.main.popitem(last=False)
            if freq > 0:
                self.main[block] = freq - 1
            elif may_go(block):
                victim = block
                break
            else:
                held.append(block)
        _put_back(self.main, held)
        return victim


def _put_back(queue: OrderedDict[bytes, int], held: list[bytes]) -> None:
    """Blocks at 0 that could not go keep their place at the old end, in their order."""
    for block in reversed(held):
        queue[block] = 0
        queue.move_to_end(block, last=False)


@dataclass(frozen=True, slots=True)
class S3FIFOPolicy:
    """S3-FIFO by name, for ``kvmesh sim``: fresh queues per cache (per tier)."""

    small_fraction: float = DEFAULT_SMALL_FRACTION
    name: str = "s3fifo"

    def queues(self, capacity: int) -> S3FIFO:
        return S3FIFO(capacity, self.small_fraction)
