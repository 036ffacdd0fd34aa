"""The L3 GC's view of the bucket: one bounded slice per pass, from listings alone.

A pass lists up to `keys_per_pass` keys after a cursor (S3 ListObjectsV2
`start-after`, 1,000 keys a request) and the cursor wraps at the bucket's
end, so k passes cover a bucket of k x keys_per_pass objects and a pass
costs the same at 10M objects as at 100k. Keys are ordered by fingerprint,
namespace, then a hash, so slices are contiguous key ranges, not prefixes
named in advance: nothing needs to know which namespaces exist.

What a listing returns is all a pass reads per object: the key (namespace,
last block hash), size, etag and Last-Modified. Last-Modified is the last
access: a write sets it and a worker's reads refresh it (shared/tiers/
l3_touch.py copies a read object onto itself once it is older than half its
TTL). An object older than the deployment's TTL (`store.ttl_s`) is a
candidate, and only a candidate gets a HEAD, for its own TTL (a named cache
writes a longer one into its metadata) and its block count: HEADs grow with
what expires, not with the bucket. A candidate its own TTL keeps is
remembered by (key, Last-Modified) until the next cycle, so it is not asked
again every pass.

A cycle is the passes from the bucket's start to its end; it adds up the
bytes per namespace that byte budgets (quotas, capacity) need, and the next
cycle's slices cut by them (`plan_gc(totals=...)`). Not thread-safe: one
pass at a time (the service's GC task).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from kvmesh.eviction.l3_gc import BucketTotals, L3Object
from kvmesh.tiers.l3_store import ABSENT_CODES, L3Store
from minio.error import S3Error


@dataclass(slots=True)
class Slice:
    objects: list[L3Object]
    after: str  # the cursor it started after ("" = the bucket's start)
    last: str  # the last key it holds ("" if none)
    wrapped: bool  # it reached the bucket's end: the next pass starts at the beginning


@dataclass
class L3Sweep:
    """Hands out slices of `store`'s bucket in key order; `keys_per_pass` None: the whole bucket each pass."""

    store: L3Store
    keys_per_pass: int | None = None
    cursor: str = ""
    totals: BucketTotals | None = None  # the last complete cycle's (None until one completed)
    cycles: int = 0
    heads: int = 0  # HEAD requests sent (candidates only)
    _counting: BucketTotals = field(default_factory=BucketTotals)
    _own_ttl: dict[str, tuple[float, float, int, int]] = field(default_factory=dict)  # key -> lm, ttl, blocks, cycle

    def next_slice(self) -> Slice:
        """The next slice's objects as listed (TTL: the store's default; blocks: unknown, 0).

        The cursor moves on in `finish`: a pass that fails before it takes the same slice again.
        """
        objects = list(list_chunks(self.store, self.cursor, self.keys_per_pass))
        wrapped = self.keys_per_pass is None or len(objects) < self.keys_per_pass
        return Slice(objects, self.cursor, objects[-1].key if objects else "", wrapped)

    def confirm(self, objects: list[L3Object], now: float) -> list[L3Object]:
        """The slice with each default-TTL candidate's own TTL and block count (a HEAD each, once);
        an object gone meanwhile is left out."""
        out: list[L3Object] = []
        for obj in objects:
            if obj.expires_at > now:
                out.append(obj)
                continue
            known = self._own_ttl.get(obj.key)
            if known is None or known[0] != obj.last_access:
                got = self._head(obj)
                if got is None:
                    continue
                known = (obj.last_access, *got, self.cycles)
            self._own_ttl[obj.key] = (*known[:3], self.cycles)
            out.append(replace(obj, ttl_s=known[1], blocks=known[2]))
        # Only candidates a longer TTL keeps are worth remembering (bounded by the named caches).
        self._own_ttl = {k: v for k, v in self._own_ttl.items() if v[1] > self.store.ttl_s}
        return out

    def finish(self, part: Slice, kept: list[L3Object]) -> None:
        """Move past the slice and count what the pass left; at the bucket's end the cycle's counts
        become `totals`."""
        self.cursor = "" if part.wrapped else part.last
        for obj in kept:
            self._counting.add(obj)
        if part.wrapped:
            self.totals, self._counting = self._counting, BucketTotals()
            self.cycles += 1
            self._own_ttl = {k: v for k, v in self._own_ttl.items() if v[3] >= self.cycles - 1}

    def prune_verified(self, verified: set[tuple[str, str]], part: Slice) -> None:
        """Forget scrub verdicts on keys in this slice's range that it no longer holds (deleted, rewritten)."""
        current = {(o.key, o.etag) for o in part.objects}

        def inside(key: str) -> bool:
            return key > part.after and (part.wrapped or key <= part.last)
        verified.difference_update({v for v in verified if inside(v[0]) and v not in current})

    def objects_known(self) -> int:
        """Objects in the bucket by the last complete cycle (else those counted so far)."""
        return (self.totals or self._counting).objects

    def _head(self, obj: L3Object) -> tuple[float, int] | None:
        self.heads += 1
        try:
            meta = self.store.client.stat_object(self.store.bucket, obj.key).metadata or {}
        except S3Error as exc:
            if exc.code in ABSENT_CODES:
                return None
            raise
        try:
            ttl = float(meta.get("x-amz-meta-ttl-s", obj.ttl_s))
            blocks = int(meta.get("x-amz-meta-blocks", 0))
        except ValueError:  # another tool's object: no TTL the GC would act on
            return (float("inf"), 0)
        return (max(ttl, 0.0), blocks)


def list_chunks(store: L3Store, after: str = "", limit: int | None = None) -> Iterator[L3Object]:
    """Chunk objects of the store's fingerprint in key order after `after`, from the listing alone.

    Keys that are not `{fingerprint}/{namespace}/{hex hash}` (another tool's objects) are skipped:
    GC never deletes what it cannot name.
    """
    prefix = f"{store.fingerprint}/" if store.fingerprint else None  # no fingerprint: every model's chunks
    n = 0
    if limit is not None and limit <= 0:
        return
    for item in store.client.list_objects(store.bucket, prefix=prefix, recursive=True,
                                          start_after=after or None):
        obj = _listed(item, store.ttl_s)
        if obj is None:
            continue
        yield obj
        n += 1
        if limit is not None and n >= limit:
            return  # before the listing asks S3 for its next page


def _listed(item, ttl_s: float) -> L3Object | None:
    parts = item.object_name.split("/")
    if len(parts) != 3 or item.is_dir or item.last_modified is None:
        return None
    try:
        bytes.fromhex(parts[2])
    except ValueError:
        return None
    return L3Object(key=item.object_name, namespace=parts[1], size=int(item.size or 0),
                    last_access=item.last_modified.timestamp(), ttl_s=float(ttl_s), blocks=0,
                    etag=(item.etag or "").strip('"'))
