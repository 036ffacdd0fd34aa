"""L3 GC against a real S3 server, objects written through `L3Store`: TTL, quota, capacity, pins.

The clock is the `now` given to `plan_gc`: "later" is a number, not a sleep.
"""

from __future__ import annotations

import io
import time
from dataclasses import replace

from kvmesh.cache_policy.registry import get_policy
from kvmesh.eviction.l3_gc import GCLimits, apply_gc, chunk_pinned, plan_gc, scan, scrub
from kvmesh.eviction.pins import PinTable
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.miss import MissReason

from .helpers import kv_chain, l3_store

FP = "fp-evict-0123456789"


def _keys(store, namespace: str, blocks) -> list[str]:
    handles = store.put_chain(namespace, [encode_kv_block(b, FP) for b in blocks])
    return sorted({h.object_key for h in handles}, key=[h.object_key for h in handles].index)


def test_ttl_deletes_exactly_the_expired(s3_server) -> None:
    store = l3_store(s3_server, FP)
    short = _keys(replace(store, ttl_s=2), "t-a", kv_chain(4, seed=1))  # 2 chunks, 2 s TTL
    long = _keys(replace(store, ttl_s=3600), "t-a", kv_chain(4, seed=2))
    objects = scan(store)
    assert {o.key for o in objects} == {*short, *long}
    assert all(o.namespace == "t-a" and o.blocks == 2 and o.size > 0 for o in objects)
    never = PinTable()
    now = time.time()
    assert plan_gc(objects, GCLimits(), get_policy("cost"), now, chunk_pinned(store, never, now)).keys == []
    later = now + 10
    plan = plan_gc(objects, GCLimits(), get_policy("cost"), later, chunk_pinned(store, never, later))
    assert sorted(plan.expired) == sorted(short) and not plan.over_quota and not plan.over_capacity
    assert apply_gc(store, plan.keys) == 2
    assert {o.key for o in scan(store)} == set(long)


def test_scan_leaves_out_an_object_deleted_between_its_listing_and_its_stat(s3_server) -> None:
    """A GC pass (or another replica's) can delete a chunk while a scan walks the listing: it is gone, not an error."""
    store = l3_store(s3_server, FP)
    keys = _keys(store, "t-race", kv_chain(4, seed=3))  # 2 chunks
    client = store.client

    class DeletesAfterListing:  # the real client; the first chunk goes once the listing is taken
        def list_objects(self, *args, **kwargs):
            listed = list(client.list_objects(*args, **kwargs))
            client.remove_object(store.bucket, keys[0])
            return listed

        def __getattr__(self, name):
            return getattr(client, name)

    assert {o.key for o in scan(replace(store, client=DeletesAfterListing()))} == {keys[1]}


def test_pinned_chunk_survives_its_ttl_even_pinned_mid_chunk(s3_server) -> None:
    store = l3_store(s3_server, FP, chunk_blocks=4)
    blocks = kv_chain(8, seed=3)
    first, second = _keys(replace(store, ttl_s=1), "t-a", blocks)
    pins = PinTable()
    later = time.time() + 10
    pins.pin([blocks[1].block_hash], until=later + 60)  # inside the first chunk: found through its TOC
    plan = plan_gc(scan(store), GCLimits(), get_policy("cost"), later, chunk_pinned(store, pins, later))
    assert plan.expired == [second]
    # Once the pin has lapsed, the chunk goes too.
    after = later + 120
    plan = plan_gc(scan(store), GCLimits(), get_policy("cost"), after, chunk_pinned(store, pins, after))
    assert sorted(plan.expired) == sorted([first, second])


def test_quota_per_namespace_then_capacity_lowest_priority_first(s3_server) -> None:
    store = l3_store(s3_server, FP)
    a_keys = _keys(store, "t-a", kv_chain(6, seed=4))  # 3 chunks
    b_keys = _keys(store, "t-b", kv_chain(4, seed=5))  # 2 chunks
    objects = scan(store)
    size = max(o.size for o in objects)
    assert all(o.size == size for o in objects)
    hot = {a_keys[2]}  # the service heard of many requests for this one
    now = time.time()

    def accesses(o) -> int:
        return 50 if o.key in hot else 1
    pins = PinTable()
    quota = GCLimits(namespace_quota_bytes=2 * size)  # t-a is one chunk over, t-b fits
    plan = plan_gc(objects, quota, get_policy("cost"), now, chunk_pinned(store, pins, now), accesses)
    assert len(plan.over_quota) == 1 and plan.over_quota[0] in a_keys and plan.over_quota[0] not in hot
    assert not plan.expired and not plan.over_capacity
    # Capacity of 2 chunks for everything: 3 of the 5 go, never the hot one nor a pinned one.
    pins.pin([bytes.fromhex(b_keys[0].rsplit("/", 1)[-1])], now + 60)
    cap = GCLimits(capacity_bytes=2 * size)
    plan = plan_gc(objects, cap, get_policy("cost"), now, chunk_pinned(store, pins, now), accesses)
    assert len(plan.over_capacity) == 3
    assert a_keys[2] not in plan.over_capacity and b_keys[0] not in plan.over_capacity
    apply_gc(store, plan.keys)
    assert {o.key for o in scan(store)} == {a_keys[2], b_keys[0]}


def test_two_workers_writing_one_prefix_leave_one_copy_and_gc_counts_it_once(s3_server) -> None:
    store = l3_store(s3_server, FP)
    other = replace(store, stats=type(store.stats)())  # a second worker's store on the same bucket
    blocks = [encode_kv_block(b, FP) for b in kv_chain(4, seed=9)]
    keys = {h.object_key for h in store.put_chain("t-a", blocks)}
    assert {h.object_key for h in other.put_chain("t-a", blocks)} == keys
    assert other.stats.chunks_written == 0 and other.stats.chunks_skipped == 2
    objects = scan(store)
    assert sorted(o.key for o in objects) == sorted(keys)
    size = objects[0].size
    now = time.time()
    plan = plan_gc(objects, GCLimits(capacity_bytes=2 * size), get_policy("cost"), now,
                   chunk_pinned(store, PinTable(), now))
    assert plan.keys == []  # two objects, not four: within a two-object budget


def test_scrub_removes_damaged_objects_and_reads_each_intact_one_once(s3_server) -> None:
    store = l3_store(s3_server, FP, chunk_blocks=2)
    gc_store = replace(store, fingerprint="")  # the eviction service's store serves no model
    good = _keys(store, "t-s", kv_chain(4, seed=21))
    bad = _keys(store, "t-s", kv_chain(2, seed=22))[0]
    body = bytearray(store.client.get_object(store.bucket, bad).read())
    body[-1] ^= 0xFF  # the tail of the last block's payload: a checksum miss
    store.client.put_object(store.bucket, bad, io.BytesIO(bytes(body)), len(body))
    verified: set[tuple[str, str]] = set()
    objects = [o for o in scan(gc_store) if o.namespace == "t-s"]
    first = scrub(gc_store, objects, verified, budget_bytes=1)  # the budget: one object this pass
    assert len(first) + len(verified) == 1
    assert first + scrub(gc_store, objects, verified, budget_bytes=10**9) == [bad]
    assert {o.key for o in scan(gc_store) if o.namespace == "t-s"} == set(good)  # already deleted
    assert {k for k, _ in verified} == set(good)
    reads = gc_store.counters.get(Tier.L3, MissReason.CHECKSUM)
    assert scrub(gc_store, [o for o in objects if o.key != bad], verified, budget_bytes=10**9) == []
    assert gc_store.counters.get(Tier.L3, MissReason.CHECKSUM) == reads and gc_store.stats.chunks_quarantined == 1
