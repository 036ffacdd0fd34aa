"""The L3 GC's listing-only passes against a real S3 server (weed): requests counted in the SDK.

A pass sends LISTs, a HEAD only per TTL candidate and batched deletes; a
worker's reads refresh Last-Modified (batched self-copies), so TTL counts
from the last read; pins keep expired chunks; slices cover the bucket over
k passes. The GC clock is the `now` given to a pass; the only waiting is
for the server's clock to tick past a second (Last-Modified has whole
seconds), so that a refreshed object is visibly newer.
"""

from __future__ import annotations

import time
from dataclasses import replace

from bus.helpers import eventually
from kvmesh.cache_policy.registry import get_policy
from kvmesh.eviction.l3_gc import (
    BucketTotals,
    GCLimits,
    L3Object,
    apply_gc,
    chunk_pinned,
    plan_gc,
)
from kvmesh.eviction.l3_sweep import L3Sweep, list_chunks
from kvmesh.eviction.pins import PinTable
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.l3_touch import L3Touches
from kvmesh.tiers.s3_requests import counting_client

from .helpers import kv_chain, l3_store

FP = "fp-sweep-0123456789"
TTL = 4  # the deployment's TTL in these tests: a read refreshes an object once it is 1 s old (share 0.25)


def _gc_store(s3_server, store: L3Store) -> L3Store:
    """The eviction service's view of the bucket: no fingerprint, the deployment's TTL, a counting client."""
    client = counting_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    return L3Store(client, store.bucket, fingerprint="", ttl_s=TTL)


def _write(store: L3Store, ns: str, seed: int, n: int = 4) -> list[str]:
    handles = store.put_chain(ns, [encode_kv_block(b, FP) for b in kv_chain(n, seed=seed)])
    return list(dict.fromkeys(h.object_key for h in handles))


def _modified(store: L3Store) -> dict[str, float]:
    return {o.key: o.last_access for o in list_chunks(store)}


async def test_a_pass_deletes_the_expired_keeps_the_recently_read_and_sends_no_head_per_object(s3_server):
    worker = replace(l3_store(s3_server, FP, chunk_blocks=2, ttl_s=TTL), touches=L3Touches(refresh_share=0.25))
    read, unread = _write(worker, "t-a", seed=1), _write(worker, "t-a", seed=2)
    gc = _gc_store(s3_server, worker)
    written = max(_modified(gc).values())
    await eventually(lambda: time.time() >= written + 1.5, 5, "the objects are 1 s old: past a quarter TTL")
    for key in read:
        assert worker.get_chunk(key) is not None
    assert worker.touches.pending() == len(read)
    assert worker.get_chunk(read[0]) and worker.touches.pending() == len(read)  # a key is pending once
    assert worker.touches.flush(worker.client, worker.bucket) == len(read) and worker.touches.pending() == 0
    modified = _modified(gc)
    assert min(modified[k] for k in read) >= max(modified[k] for k in unread) + 1
    meta = gc.client.stat_object(gc.bucket, read[0]).metadata
    assert meta["x-amz-meta-ttl-s"] == str(TTL) and meta["x-amz-meta-blocks"] == "2"  # the copy kept them

    now = max(modified[k] for k in unread) + TTL + 0.5  # the unread ones expired, the read ones not
    gc.client.reset()
    sweep = L3Sweep(gc, keys_per_pass=1000)
    part = sweep.next_slice()
    objects = sweep.confirm(part.objects, now)
    plan = plan_gc(objects, GCLimits(), get_policy("cost"), now, chunk_pinned(gc, PinTable(), now))
    assert sorted(plan.expired) == sorted(unread) and part.wrapped
    assert apply_gc(gc, plan.keys) == len(unread)
    sent = gc.client.reset()
    # One page of the listing, a HEAD per candidate (not per object), one batched delete.
    assert sent == {"LIST": 1, "HEAD": len(unread), "DELETE_MULTI": 1}
    assert set(_modified(gc)) == set(read)


def test_an_expired_chunk_pinned_anywhere_survives_and_a_longer_ttl_is_asked_once(s3_server):
    worker = l3_store(s3_server, FP, chunk_blocks=2, ttl_s=TTL)
    blocks = kv_chain(4, seed=3)
    pinned, free = worker.put_chain("t-p", [encode_kv_block(b, FP) for b in blocks])[::2]
    named = _write(replace(worker, ttl_s=3600), "t-p", seed=4)  # a named cache's longer TTL
    gc = _gc_store(s3_server, worker)
    pins = PinTable()
    now = max(_modified(gc).values()) + TTL + 1
    pins.pin([blocks[0].block_hash], until=now + 60)  # the first block of the first chunk: found in its TOC
    sweep = L3Sweep(gc)
    objects = sweep.confirm(sweep.next_slice().objects, now)
    plan = plan_gc(objects, GCLimits(), get_policy("cost"), now, chunk_pinned(gc, pins, now))
    assert plan.expired == [free.object_key]
    assert {o.key: o.ttl_s for o in objects if o.key in named} == {k: 3600 for k in named}
    assert pinned.object_key not in plan.keys
    gc.client.reset()
    again = sweep.confirm(sweep.next_slice().objects, now)  # the next pass: the named cache's TTL is known
    assert {o.key for o in again} == {pinned.object_key, free.object_key, *named}
    assert gc.client.reset()["HEAD"] == 2  # the two default-TTL candidates, not the named cache's


def test_slices_cover_the_bucket_over_k_passes_each_bounded(s3_server):
    worker = l3_store(s3_server, FP, chunk_blocks=1, ttl_s=TTL)
    keys = _write(worker, "t-s", seed=5, n=10)  # 10 objects, one block each
    gc = _gc_store(s3_server, worker)
    sweep = L3Sweep(gc, keys_per_pass=3)
    unfinished = sweep.next_slice()  # a pass that failed before `finish`: the next one takes the same slice
    assert [o.key for o in sweep.next_slice().objects] == [o.key for o in unfinished.objects]
    seen: list[str] = []
    parts = []
    for _ in range(4):
        part = sweep.next_slice()
        assert len(part.objects) <= 3
        seen += [o.key for o in part.objects]
        sweep.finish(part, part.objects)
        parts.append(part)
    assert sweep.next_slice().objects == parts[0].objects  # wrapped: the next pass starts over
    assert [p.wrapped for p in parts] == [False, False, False, True]
    assert sorted(seen) == sorted(keys) and len(seen) == len(set(seen))
    assert sweep.totals == BucketTotals({"t-s": sum(o.size for p in parts for o in p.objects)}, 10)
    # Now everything is expired: each pass deletes its own slice only, and 4 passes empty the bucket.
    later = max(_modified(gc).values()) + TTL + 1
    deleted = []
    for _ in range(4):
        part = sweep.next_slice()
        plan = plan_gc(sweep.confirm(part.objects, later), GCLimits(), get_policy("cost"), later,
                       chunk_pinned(gc, PinTable(), later))
        assert len(plan.expired) == len(part.objects) <= 3
        deleted.append(apply_gc(gc, plan.keys))
        sweep.finish(part, [])
    assert deleted == [3, 3, 3, 1] and _modified(gc) == {}


def test_a_slice_cuts_its_share_of_a_namespace_over_quota() -> None:
    def obj(ns: str, i: int) -> L3Object:
        return L3Object(f"fp/{ns}/{i:064x}", ns, 100, last_access=1000.0 + i, ttl_s=10**6, blocks=1)
    # Bucket-wide (last cycle): t-a holds 8 objects over a quota of 4, t-b 2 under it.
    totals = BucketTotals({"t-a": 800, "t-b": 200}, 10)
    part = [obj("t-a", i) for i in range(4)] + [obj("t-b", 9)]
    plan = plan_gc(part, GCLimits(namespace_quota_bytes=400), get_policy("lru"), 2000.0, lambda o: False,
                   totals=totals)
    # Half of t-a is over: half of this slice's t-a goes, the least recently used first; t-b untouched.
    assert plan.over_quota == [obj("t-a", 0).key, obj("t-a", 1).key]
    whole = plan_gc(part, GCLimits(namespace_quota_bytes=400), get_policy("lru"), 2000.0, lambda o: False)
    assert whole.over_quota == []  # read as the whole bucket, the 4 objects fit the quota
