"""PrefixCache: hits, sharing, eviction order, collisions, events; property-tested accounting."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.base import BlockInfo, LRUPolicy
from kvmesh.engine.block_pool import Block, BlockPool
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.protocol.block_hash import BlockHash, HashKeys, hash_blocks

BS = 4
KEYS = HashKeys("fp")


class FewestAccessesPolicy:
    """A non-LRU priority (LFU-like) to exercise the generic heap path."""

    name = "test-lfu"

    def priority(self, info: BlockInfo, now: float) -> float:
        return float(info.access_count)

    def admit(self, info: BlockInfo, now: float) -> bool:
        return True


class RejectDeepPolicy(LRUPolicy):
    name = "reject-deep"

    def admit(self, info: BlockInfo, now: float) -> bool:
        return info.depth == 0


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def block_stored(self, block_hash: BlockHash, parent_hash: BlockHash | None, num_tokens: int) -> None:
        self.events.append(("stored", block_hash, parent_hash, num_tokens))

    def block_removed(self, block_hash: BlockHash) -> None:
        self.events.append(("removed", block_hash))


def make_cache(num_blocks: int, policy=None, listener=None) -> PrefixCache:
    ticks = itertools.count()
    return PrefixCache(BlockPool(num_blocks), BS, policy, listener, clock=lambda: float(next(ticks)))


def run_sequence(cache: PrefixCache, tokens: list[int]) -> list[Block] | None:
    """What the scheduler does for one sequence: take the cached prefix, allocate and store the rest."""
    hashes = hash_blocks(tokens, BS, KEYS)
    hit = cache.acquire_prefix(hashes, tokens)
    need = -(-len(tokens) // BS) - len(hit)
    fresh = cache.allocate(need)
    if fresh is None:
        cache.release(hit)
        return None
    blocks = hit + fresh
    for i in range(len(hit), len(hashes)):
        cache.store(blocks[i], hashes[i], hashes[i - 1] if i else None, tuple(tokens[i * BS : (i + 1) * BS]), i)
    return blocks


def test_hit_after_release_and_shared_refcounts() -> None:
    cache = make_cache(8)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    a = run_sequence(cache, tokens)
    assert a is not None and len(cache) == 2
    b = run_sequence(cache, tokens[:8] + [99, 98, 97, 96])
    assert b[:2] == a[:2] and all(x.ref_count == 2 for x in a[:2])
    cache.release(a)
    cache.release(b)
    assert cache.num_allocatable == 8 and cache.num_evictable == 3
    assert cache.stats.queries == 2 and cache.stats.hit_tokens == 8
    assert len(cache.lookup(hash_blocks(tokens, BS, KEYS), tokens)) == 2


def test_free_blocks_are_used_before_evicting() -> None:
    cache = make_cache(4)
    seq = run_sequence(cache, list(range(8)))
    cache.release(seq)
    got = cache.allocate(2)
    assert got is not None and cache.stats.evictions == 0 and len(cache) == 2
    got2 = cache.allocate(1)
    assert cache.stats.evictions == 1 and len(cache) == 1
    cache.release(got + got2)


def test_lru_evicts_chain_tail_first_and_oldest_chain_first() -> None:
    rec = Recorder()
    cache = make_cache(4, listener=rec)
    old = run_sequence(cache, list(range(8)))
    new = run_sequence(cache, list(range(100, 108)))
    cache.release(old)
    cache.release(new)
    old_hashes = hash_blocks(list(range(8)), BS, KEYS)
    cache.allocate(1)
    assert rec.events[-1] == ("removed", old_hashes[1])
    cache.allocate(1)
    assert rec.events[-1] == ("removed", old_hashes[0])
    stored = [e for e in rec.events if e[0] == "stored"]
    assert stored[0] == ("stored", old_hashes[0], None, BS)
    assert stored[1] == ("stored", old_hashes[1], old_hashes[0], BS)


def test_generic_policy_evicts_lowest_priority() -> None:
    cache = make_cache(2, policy=FewestAccessesPolicy())
    hot, cold = [1, 2, 3, 4], [5, 6, 7, 8]
    for _ in range(3):
        cache.release(run_sequence(cache, hot))
    cache.release(run_sequence(cache, cold))
    cache.allocate(1)
    assert hash_blocks(hot, BS, KEYS)[0] in cache
    assert hash_blocks(cold, BS, KEYS)[0] not in cache


def test_policy_admission_is_respected() -> None:
    cache = make_cache(4, policy=RejectDeepPolicy())
    cache.release(run_sequence(cache, list(range(8))))
    assert len(cache) == 1 and cache.stats.rejected == 1
    assert cache.pool.num_free == 3


def test_collision_is_a_miss() -> None:
    cache = make_cache(4)
    tokens = list(range(8))
    cache.release(run_sequence(cache, tokens))
    # Tamper with the stored token ids: the hash still matches, the content does not.
    victim = cache.get(hash_blocks(tokens, BS, KEYS)[1])
    victim.token_ids = (9, 9, 9, 9)
    hit = cache.acquire_prefix(hash_blocks(tokens, BS, KEYS), tokens)
    assert len(hit) == 1 and cache.stats.collisions == 1
    cache.release(hit)


@st.composite
def operations(draw):
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23]]
    ops = []
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["run", "run", "release", "lookup", "alloc"]))
        if kind in ("run", "lookup"):
            base = draw(st.sampled_from(prefixes))
            tail = draw(st.lists(st.integers(0, 5), max_size=9))
            ops.append((kind, base + tail))
        else:
            ops.append((kind, draw(st.integers(0, 5))))
    return ops


def check_invariants(cache: PrefixCache, live: list[tuple[list[int], list[Block]]]) -> None:
    pool = cache.pool
    expected_refs = [0] * pool.num_blocks
    for _, blocks in live:
        for b in blocks:
            expected_refs[b.block_id] += 1
    assert [b.ref_count for b in pool.blocks] == expected_refs  # never negative, never lost
    # A block in use keeps its content: eviction never took it.
    for tokens, blocks in live:
        for i, b in enumerate(blocks):
            if b.block_hash is not None:
                assert b.token_ids == tuple(tokens[i * BS : (i + 1) * BS])
    in_use = sum(1 for r in expected_refs if r > 0)
    assert pool.num_free + cache.num_evictable + in_use == pool.num_blocks
    assert cache.num_evictable == sum(1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None)
    for b in pool.blocks:
        if b.block_hash is not None:
            assert cache.get(b.block_hash) is b


@settings(max_examples=60, deadline=None)
@given(ops=operations(), num_blocks=st.integers(3, 10), lru=st.booleans())
def test_random_operations_keep_accounting(ops, num_blocks: int, lru: bool) -> None:
    cache = make_cache(num_blocks, policy=None if lru else FewestAccessesPolicy())
    live: list[tuple[list[int], list[Block]]] = []
    for kind, arg in ops:
        if kind == "run":
            blocks = run_sequence(cache, arg)
            if blocks is not None:
                live.append((arg, blocks))
        elif kind == "release" and live:
            _, blocks = live.pop(arg % len(live))
            cache.release(blocks)
        elif kind == "lookup":
            hit = cache.lookup(hash_blocks(arg, BS, KEYS), arg)
            for i, b in enumerate(hit):
                assert b.token_ids == tuple(arg[i * BS : (i + 1) * BS])
        elif kind == "alloc":
            got = cache.allocate(arg)
            if got is None:
                assert arg > cache.num_allocatable
            else:
                live.append(([], got))  # uncached scratch blocks
        check_invariants(cache, live)
    for _, blocks in live:
        cache.release(blocks)
    check_invariants(cache, [])
    assert cache.num_allocatable == num_blocks
