"""L3 garbage collection: delete chunk objects past their TTL, over a tenant's quota, over the bucket budget,
and damaged ones a scrub finds.

L3 is content-addressed (`{fingerprint}/{namespace}/{last block hash}`):
two workers writing the same chunk write one object, so there is one copy
per block by construction and GC never has duplicates to reconcile; it only
decides which objects go. The service's passes get the facts from
listings alone (l3_sweep.py: key, size, Last-Modified as the last access,
a HEAD only for a TTL candidate); `scan` reads every object's metadata as
`L3Store.put_chunk` wrote it (namespace, ttl-s, last-access, blocks), one
HEAD per object: an inspection tool and the old pass's baseline
(bench/l3_gc.py), not the service's pass. Order of the cuts: expired first, then
each namespace down to its quota, then the bucket down to its byte budget;
within a cut, the policy's lowest priority goes first. A pinned chunk (any
of its blocks pinned) is never deleted, not even when expired. A pass over
one slice of the bucket cuts each budget in proportion (`BucketTotals`:
the bytes the last full cycle counted).

`scrub` reads every object once (again only if it changes), a byte budget
per pass, and removes the damaged: no reader would ever be served them, but
they would hold their key (writers skip existing keys) and their bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvmesh.cache_policy.base import BlockInfo, EvictionPolicy
from kvmesh.eviction.pins import PinTable
from kvmesh.tiers.l3_store import ABSENT_CODES, DAMAGED, L3Store
from kvmesh.tiers.miss import Miss
from minio.deleteobjects import DeleteObject
from minio.error import S3Error


@dataclass(slots=True, frozen=True)
class L3Object:
    key: str
    namespace: str
    size: int
    last_access: float  # unix seconds
    ttl_s: float
    blocks: int
    etag: str = ""  # changes when the object is rewritten: a scrub verifies it again

    @property
    def last_hash(self) -> bytes:
        return bytes.fromhex(self.key.rsplit("/", 1)[-1])

    @property
    def expires_at(self) -> float:
        return self.last_access + self.ttl_s


@dataclass(slots=True, frozen=True)
class GCLimits:
    capacity_bytes: int | None = None  # the whole bucket (this fingerprint's objects); None: unbounded
    namespace_quota_bytes: int | None = None  # default quota of every namespace
    quotas: Mapping[str, int] = field(default_factory=dict)  # per-namespace overrides

    def quota(self, namespace: str) -> int | None:
        return self.quotas.get(namespace, self.namespace_quota_bytes)


@dataclass(slots=True)
class BucketTotals:
    """Bytes per namespace and objects of the bucket, as one full cycle of slices counted them."""

    bytes_by_ns: dict[str, int] = field(default_factory=dict)
    objects: int = 0

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_ns.values())

    def add(self, obj: L3Object) -> None:
        self.bytes_by_ns[obj.namespace] = self.bytes_by_ns.get(obj.namespace, 0) + obj.size
        self.objects += 1


@dataclass(slots=True)
class GCPlan:
    expired: list[str] = field(default_factory=list)
    over_quota: list[str] = field(default_factory=list)
    over_capacity: list[str] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return [*self.expired, *self.over_quota, *self.over_capacity]


def scan(store: L3Store) -> list[L3Object]:
    """Every chunk object of the store's fingerprint with its metadata (one stat per object).

    An object deleted between its listing and its stat (a GC pass running meanwhile) is left out.
    """
    out: list[L3Object] = []
    prefix = f"{store.fingerprint}/" if store.fingerprint else None  # no fingerprint: every model's chunks
    for item in store.client.list_objects(store.bucket, prefix=prefix, recursive=True):
        try:
            st = store.client.stat_object(store.bucket, item.object_name)
        except S3Error as exc:
            if exc.code in ABSENT_CODES:
                continue
            raise
        meta = st.metadata or {}
        def get(name: str, default: str) -> str:
            return meta.get(f"x-amz-meta-{name}", default)
        out.append(L3Object(key=item.object_name, namespace=get("namespace", item.object_name.split("/")[1]),
                            size=int(st.size or 0), last_access=float(get("last-access", "0")),
                            ttl_s=float(get("ttl-s", str(store.ttl_s))), blocks=int(get("blocks", "1")),
                            etag=st.etag or ""))
    return out


def scrub(store: L3Store, objects: Iterable[L3Object], verified: set[tuple[str, str]],
          budget_bytes: int) -> list[str]:
    """Verify objects not in `verified` (key, etag) until `budget_bytes` are read; the damaged ones' keys.

    Reading a damaged object through the store deletes it (`L3Store.get_chunk`); `verified` gains the
    good ones. An object that could not be read (S3 away) is tried again next pass.
    """
    damaged: list[str] = []
    spent = 0
    for obj in objects:
        if (obj.key, obj.etag) in verified:
            continue
        if spent >= budget_bytes:
            break
        spent += obj.size
        result = store.get_chunk(obj.key)
        if not isinstance(result, Miss):
            verified.add((obj.key, obj.etag))
        elif result.reason in DAMAGED:
            damaged.append(obj.key)
    return damaged


def chunk_pinned(store: L3Store, pins: PinTable, now: float) -> Callable[[L3Object], bool]:
    """Whether any block of a chunk is pinned: its key names the last; the others need its TOC (read lazily).

    A TOC that cannot be read counts as pinned: GC deletes only what it knows is unpinned.
    """
    def pinned(obj: L3Object) -> bool:
        if not len(pins):
            return False
        if pins.pinned(obj.last_hash, now):
            return True
        toc = store.read_toc(obj.key, max_blocks=obj.blocks or 256)  # 0: a listing does not say
        return isinstance(toc, Miss) or pins.any_pinned((h for h, _, _ in toc), now)
    return pinned


def plan_gc(objects: Iterable[L3Object], limits: GCLimits, policy: EvictionPolicy, now: float,
            pinned: Callable[[L3Object], bool], accesses: Callable[[L3Object], int] = lambda o: 1,
            totals: BucketTotals | None = None) -> GCPlan:
    """The keys to delete and why; pure apart from the callbacks (pins, access counts).

    `objects` is the whole bucket (`totals` None: budgets are exact) or one slice of it: then a
    namespace over its quota in `totals` keeps quota/total of its bytes in this slice (the capacity
    likewise), so a full cycle of slices cuts each budget's excess once.
    """
    plan = GCPlan()
    live: list[L3Object] = []
    for obj in objects:
        (plan.expired if obj.expires_at <= now and not pinned(obj) else live).append(obj)
    plan.expired = [o.key for o in plan.expired]

    def rank(obj: L3Object) -> float:
        info = BlockInfo(obj.last_hash, None, 0, max(obj.blocks, 1), max(obj.size, 1), obj.last_access,
                         obj.last_access, max(accesses(obj), 1))
        return policy.priority(info, now)

    by_ns: dict[str, list[L3Object]] = {}
    for obj in live:
        by_ns.setdefault(obj.namespace, []).append(obj)
    for ns, objs in by_ns.items():
        quota = limits.quota(ns)
        if quota is not None:
            total = None if totals is None else totals.bytes_by_ns.get(ns)
            plan.over_quota += _cut(objs, _share(objs, quota, total), rank, pinned)
    gone = set(plan.over_quota)
    live = [o for o in live if o.key not in gone]
    if limits.capacity_bytes is not None:
        budget = _share(live, limits.capacity_bytes, None if totals is None else totals.bytes)
        plan.over_capacity = _cut(live, budget, rank, pinned)
    return plan


def _share(objs: list[L3Object], budget: int, total: int | None) -> int:
    """The budget of this slice: all of it for the whole bucket, else the slice's share of it."""
    if total is None or total <= budget:
        return budget if total is None else sum(o.size for o in objs)
    return int(sum(o.size for o in objs) * budget / total)


def apply_gc(store: L3Store, keys: Iterable[str]) -> int:
    """Delete the objects, up to 1,000 per request (S3 DeleteObjects); returns how many went.

    An absent one counts (S3 DELETE is idempotent); one S3 refused does not.
    """
    keys = list(keys)
    if not keys:
        return 0
    errors = list(store.client.remove_objects(store.bucket, (DeleteObject(k) for k in keys)))
    return len(keys) - len(errors)


def _cut(objs: list[L3Object], budget: int, rank: Callable[[L3Object], float],
         pinned: Callable[[L3Object], bool]) -> list[str]:
    total = sum(o.size for o in objs)
    out: list[str] = []
    for obj in sorted(objs, key=rank):
        if total <= budget:
            break
        if pinned(obj):
            continue
        out.append(obj.key)
        total -= obj.size
    return out
