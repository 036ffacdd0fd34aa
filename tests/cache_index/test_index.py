"""BlockIndex lookups (leading runs per worker, tier runs, L3 run) and the snapshot blob."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_index import snapshot
from kvmesh.cache_index.feeds import Feed, IndexState
from kvmesh.cache_index.index import BlockIndex, TierRunResult, key_of
from kvmesh.protocol.blocks import Tier


def keys(n: int, salt: str = "") -> list[int]:
    return [key_of(hashlib.sha256(f"{salt}{i}".encode()).hexdigest()) for i in range(n)]


def test_lookup_leading_runs_per_worker_with_tiers_and_l3():
    k = keys(10)
    idx = BlockIndex()
    idx.add("a", Tier.L1, k[:3])
    idx.add("a", Tier.L2, k[3:6])
    idx.add("a", Tier.L1, k[7:])  # after a hole: unreachable as a prefix
    idx.add("b", Tier.L2, k[:2])
    idx.add("b", Tier.L1, k[2:8])
    idx.add("c", Tier.L1, k[1:5])  # misses block 0: no prefix at all
    idx.add("", Tier.L3, k[:4])
    res = idx.lookup(k)
    assert set(res.workers) == {"a", "b"}
    assert res.workers["a"].blocks == 6
    assert res.workers["a"].runs == (TierRunResult(Tier.L1, 3), TierRunResult(Tier.L2, 3))
    assert res.workers["b"].blocks == 8
    assert res.workers["b"].runs == (TierRunResult(Tier.L2, 2), TierRunResult(Tier.L1, 6))
    assert res.l3_blocks == 4
    both = BlockIndex()
    both.add("a", Tier.L1, k[:2])
    both.add("a", Tier.L2, k[:4])  # in L1 and L2: L1 counts
    r = both.lookup(k).workers["a"]
    assert r.blocks == 4 and r.runs == (TierRunResult(Tier.L1, 2), TierRunResult(Tier.L2, 2))


def test_lookup_after_discard_and_clear_worker_keeps_l3():
    k = keys(5)
    idx = BlockIndex()
    idx.add("a", Tier.L1, k)
    idx.add("b", Tier.L1, k)
    idx.add("", Tier.L3, k)
    idx.discard("a", Tier.L1, k[2:3])
    assert idx.lookup(k).workers["a"].blocks == 2
    idx.clear_worker("b", release=True)
    assert "b" not in idx.lookup(k).workers and idx.lookup(k).l3_blocks == 5
    idx.add("d", Tier.L2, k[:1])  # takes b's freed slot, starts empty
    assert idx.lookup(k).workers["d"].blocks == 1
    assert idx.worker_blocks("a", Tier.L1) == 4 and idx.worker_blocks("d", Tier.L2) == 1
    assert idx.worker_keys("a", Tier.L1) == set(k) - {k[2]} and idx.worker_keys("d", Tier.L2) == {k[0]}
    assert idx.worker_keys("a", Tier.L2) == set() and idx.worker_keys("b", Tier.L1) == set()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([Tier.L1, Tier.L2, Tier.L3]),
                          st.integers(0, 11), st.integers(1, 6), st.booleans()), max_size=60))
def test_lookup_matches_a_naive_scan(ops):
    k = keys(12)
    idx = BlockIndex()
    truth: dict[tuple[str, Tier], set[int]] = {}
    for w, tier, start, n, add in ops:
        name = "" if tier is Tier.L3 else f"w{w}"
        part = k[start : start + n]
        held = truth.setdefault((name, tier), set())
        if add:
            idx.add(name, tier, part)
            held.update(part)
        else:
            idx.discard(name, tier, part)
            held.difference_update(part)
    res = idx.lookup(k)

    def leading(has) -> int:
        n = 0
        while n < len(k) and has(k[n]):
            n += 1
        return n

    for name in {n for n, t in truth if t is not Tier.L3}:
        held = truth.get((name, Tier.L1), set()) | truth.get((name, Tier.L2), set())
        n = leading(held.__contains__)
        got = res.workers.get(name)
        assert (got.blocks if got else 0) == n
        if got:
            tiers = [r.tier for r in got.runs for _ in range(r.blocks)]
            assert tiers == [Tier.L1 if x in truth.get((name, Tier.L1), ()) else Tier.L2 for x in k[:n]]
    assert res.l3_blocks == leading(lambda x: x in truth.get(("", Tier.L3), ()))


@pytest.mark.parametrize("workers", [3, 40])  # 40 workers: masks wider than one 64-bit word
def test_snapshot_round_trip(workers):
    state = IndexState(stream_seq=77, events_applied=5)
    for w in range(workers):
        state.index.add(f"w{w}", Tier.L1 if w % 2 else Tier.L2, keys(50, salt=str(w % 4)))
        state.feeds[f"w{w}"] = Feed(epoch=1000 + w, next_seq=w + 3, gap=w == 1, dead=False)
    state.index.add("", Tier.L3, keys(20))
    state.index.clear_worker("w2", release=True)
    back = snapshot.decode(snapshot.encode(state))
    assert back.stream_seq == 77 and back.events_applied == 5
    assert back.index.masks == state.index.masks and back.index.slots == state.index.slots
    assert back.index.counts == state.index.counts
    assert {w: (f.epoch, f.next_seq, f.gap) for w, f in back.feeds.items()} == \
        {w: (f.epoch, f.next_seq, f.gap) for w, f in state.feeds.items()}
    probe = keys(50, salt="1")
    assert back.index.lookup(probe) == state.index.lookup(probe)
    back.index.add("new", Tier.L1, probe[:1])  # reuses w2's freed slot
    assert back.index.slots["new"] == 2


def test_corrupt_snapshot_is_rejected():
    state = IndexState()
    state.index.add("a", Tier.L1, keys(10))
    blob = bytearray(snapshot.encode(state))
    blob[-3] ^= 0xFF
    with pytest.raises(snapshot.SnapshotError):
        snapshot.decode(bytes(blob))
    with pytest.raises(snapshot.SnapshotError):
        snapshot.decode(b"not a snapshot")


def test_a_wide_fleet_costs_no_more_per_block_and_masks_are_shared():
    """Blocks of worker slot 999 (2,000-bit masks) take the bytes blocks of slot 0 take; lookups still answer."""
    narrow, wide = BlockIndex(), BlockIndex()
    for i in range(1000):
        wide.slot(f"w{i}")
    ks = keys(2000, "wide")
    narrow.add("w0", Tier.L1, ks)
    wide.add("w999", Tier.L1, ks)
    assert wide.nbytes() <= narrow.nbytes() + 1024
    assert len({id(m) for m in wide.masks.values()}) == 1
    assert wide.lookup(ks[:10]).workers["w999"].blocks == 10
    wide.clear_worker("w999", release=True)
    wide.add("w5", Tier.L2, ks[:3])
    assert set(wide.lookup(ks[:3]).workers) == {"w5"} and wide.lookup(ks).l3_blocks == 0
