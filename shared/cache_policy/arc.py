"""ARC (Megiddo & Modha, FAST'03) as a reference policy: recency and frequency lists with an adaptive split.

Resident blocks sit in T1 (seen once lately) or T2 (seen at least twice);
ghost lists B1 and B2 remember keys evicted from T1 and T2. The target
size ``p`` of T1 moves with the ghosts: a miss found in B1 says T1 was too
small (p grows), one found in B2 says T2 was (p shrinks), each step larger
when the other ghost list is the longer. Room is made from T1 while it is
above its target (or at it, for a B2 miss), otherwise from T2, always at
the least recently used end; the lists stay within |T1| + |T2| <= c,
|T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.

Prefix chains (see ``queue_cache``): the victim is the least recently
used block of the chosen list that may go (a leaf, not pinned, not in the
request in flight); one that may not keeps its place. If the list has
none, the other list's is taken; if neither has one, the missed block is
not cached (its ghost entry, if any, stays). A request reads its chain at
once, and ARC records it leaf-first: its deepest block as the least
recent, its first block as the most, so within a list a chain's leaf is
met before its parents. A parent is passed over while its children sit in
the other list: a prefix in T2 whose new blocks wait in T1, or a parent the
ghosts forgot, restarted in T1, whose child came back from B1 or B2 into T2.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvmesh.cache_policy.queue_cache import Admission, MayGo

Lru = OrderedDict[bytes, None]  # least recently used first


class ARC:
    """The four lists and the target ``p`` of one cache of ``capacity`` blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0  # target size of T1
        self.t1: Lru = OrderedDict()
        self.t2: Lru = OrderedDict()
        self.b1: Lru = OrderedDict()
        self.b2: Lru = OrderedDict()
        self._request: list[bytes] = []  # read or inserted during the current request, in chain order

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def read(self, block: bytes) -> None:
        self.t1.pop(block, None)
        self.t2[block] = None
        self.t2.move_to_end(block)
        self._request.append(block)

    def insert(self, block: bytes, may_go: MayGo) -> Admission:
        c = self.capacity
        full = len(self) >= c
        victim = None
        if block in self.b1 or block in self.b2:
            in_b1 = block in self.b1
            home, other = (self.b1, self.b2) if in_b1 else (self.b2, self.b1)
            step = max(1.0, len(other) / len(home))
            self.p = min(float(c), self.p + step) if in_b1 else max(0.0, self.p - step)
            if full:
                victim = self._replace(may_go, missed_in_b2=not in_b1)
                if victim is None:
                    return Admission(cached=False)
            del home[block]
            self.t2[block] = None
        else:
            if len(self.t1) + len(self.b1) >= c:
                if len(self.t1) < c:
                    self.b1.popitem(last=False)
                    victim = self._replace(may_go, missed_in_b2=False) if full else None
                else:  # T1 alone fills the cache: its LRU block goes, remembered nowhere
                    victim = self._take(self.t1, None, may_go)
            elif len(self) + len(self.b1) + len(self.b2) >= c:
                if len(self) + len(self.b1) + len(self.b2) >= 2 * c:
                    self.b2.popitem(last=False)
                victim = self._replace(may_go, missed_in_b2=False) if full else None
            if full and victim is None:
                return Admission(cached=False)
            self.t1[block] = None
        self._request.append(block)
        return Admission(cached=True, evicted=victim)

    def discard(self, block: bytes) -> None:
        if block in self.t1:
            del self.t1[block]
        else:
            del self.t2[block]

    def end_request(self) -> None:
        for block in reversed(self._request):  # the deepest first: it ends the least recent of the request
            if block in self.t1:
                self.t1.move_to_end(block)
            elif block in self.t2:
                self.t2.move_to_end(block)
        self._request.clear()

    def _replace(self, may_go: MayGo, missed_in_b2: bool) -> bytes | None:
        """Evict from T1 into B1 or from T2 into B2, by the target ``p``; the other list if the first has none."""
        t1_first = bool(self.t1) and (len(self.t1) > self.p or (missed_in_b2 and len(self.t1) == self.p))
        if t1_first:
            return self._take(self.t1, self.b1, may_go) or self._take(self.t2, self.b2, may_go)
        return self._take(self.t2, self.b2, may_go) or self._take(self.t1, self.b1, may_go)

    @staticmethod
    def _take(resident: Lru, ghost: Lru | None, may_go: MayGo) -> bytes | None:
        """Evict the least recently used block of ``resident`` that may go; remember it in ``ghost``."""
        for block in resident:
            if may_go(block):
                del resident[block]
                if ghost is not None:
                    ghost[block] = None
                return block
        return None


@dataclass(frozen=True, slots=True)
class ARCPolicy:
    """ARC by name, for ``kvmesh sim``: fresh lists per cache (per tier)."""

    name: str = "arc"

    def queues(self, capacity: int) -> ARC:
        return ARC(capacity)
