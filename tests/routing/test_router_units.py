"""Router.pick_prefill on a WorkerTable fed real Heartbeat messages; the ingress's fingerprint."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_index.messages import LookupReply, TierRun, WorkerMatch
from kvmesh.config import IngressSettings
from kvmesh.engine.loader import load_model
from kvmesh.engine.presets import write_preset
from kvmesh.ingress.routing.prefix_locator import model_fingerprint
from kvmesh.ingress.routing.rates import PrefillRates
from kvmesh.ingress.routing.router import Router, home
from kvmesh.ingress.routing.workers import WorkerTable
from kvmesh.protocol.block_hash import HashKeys, hash_blocks
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.messages import Heartbeat, Role
from kvmesh.service.watch import Change, WorkerChange

BLOCK = 16


def table_of(loads: dict[str, float]) -> WorkerTable:
    table = WorkerTable()
    for w, load in loads.items():
        hb = Heartbeat(worker_id=w, role=Role.PREFILL, load=load, capacity=8, started_at=datetime.now(UTC),
                       http_endpoint="http://127.0.0.1:1", seq=0, ttl_s=2)
        table.apply(WorkerChange(Change.UP, w, hb))
    return table


def held_by(worker: str, blocks: int, tier: Tier = Tier.L1) -> LookupReply:
    return LookupReply(workers=[WorkerMatch(worker=worker, blocks=blocks, runs=[TierRun(tier=tier, blocks=blocks)])],
                       l3_blocks=0, indexed_blocks=blocks, ready=True)


def test_the_prefix_holder_wins_over_a_less_loaded_worker():
    router = Router.of(table_of({"p1": 1, "p2": 0}), IngressSettings())
    assert router.pick_prefill(40 * BLOCK, BLOCK, held_by("p1", 40)) == "p1"
    assert router.pick_prefill(40 * BLOCK, BLOCK, held_by("p2", 40)) == "p2"
    assert router.pick_prefill(40 * BLOCK, BLOCK, held_by("p1", 0 + 1)) == "p2"  # 1 block: load decides


def test_bounded_load_guard_moves_a_hot_prefix_off_its_holder():
    table = table_of({"p1": 0, "p2": 0})
    router = Router.of(table, IngressSettings(load_bound=1.5))
    picks = []
    for _ in range(6):
        w = router.pick_prefill(40 * BLOCK, BLOCK, held_by("p1", 40))
        picks.append(w)
        table.acquire(w)  # the request stays in flight
    assert picks[:2] == ["p1", "p1"] and "p2" in picks
    assert table.view("p1").in_flight <= 1.5 * (6 + 1) / 2 + 1


def test_affinity_is_a_bonus_not_a_veto():
    table = table_of({"p1": 0, "p2": 0})
    key = "sess-7"
    router = Router.of(table, IngressSettings())
    other = "p2" if home(key, ["p1", "p2"]) == "p1" else "p1"
    assert router.pick_prefill(40 * BLOCK, BLOCK, held_by(other, 40), affinity_key=key) == other
    assert router.pick_prefill(2 * BLOCK, BLOCK, held_by(other, 0 + 1), affinity_key=key) == home(key, ["p1", "p2"])


def test_without_an_index_answer_it_routes_by_load_and_a_slow_worker_is_avoided():
    router = Router.of(table_of({"p1": 3, "p2": 0}), IngressSettings())
    assert router.pick_prefill(40 * BLOCK, BLOCK, None) == "p2"
    rates = PrefillRates(prior_s_per_token=1e-4)
    router = Router.of(table_of({"p1": 0, "p2": 0}), IngressSettings())
    router.rates = rates
    rates.observe("p1", 1.0, 100)  # 10 ms/token measured
    rates.observe("p2", 0.01, 100)  # 0.1 ms/token
    cold = LookupReply(workers=[], l3_blocks=0, indexed_blocks=0, ready=True)
    assert router.pick_prefill(40 * BLOCK, BLOCK, cold) == "p2"


def test_prefill_rates_ewma():
    rates = PrefillRates(prior_s_per_token=1.0, alpha=0.5, min_tokens=4)
    assert rates.rate("w") == 1.0
    rates.observe("w", 2.0, 100)
    rates.observe("w", 4.0, 100)
    assert rates.rate("w") == pytest.approx(0.03)
    rates.observe("w", 100.0, 2)  # too short to be a rate sample
    assert rates.rate("w") == pytest.approx(0.03)
    rates.observe("v", 1.0, 100)
    assert rates.rate("never-seen") == pytest.approx((0.03 + 0.01) / 2)  # the mean of the measured
    rates.forget({"x"})
    assert rates.rate("w") == 1.0


def test_ingress_fingerprint_and_hashes_match_the_loaded_model(tmp_path: Path):
    model_dir = write_preset(tmp_path / "m", "tiny", "llama", seed=3)
    loaded = load_model(model_dir)
    assert model_fingerprint(model_dir) == loaded.fingerprint
    assert model_fingerprint(model_dir, "bfloat16") == load_model(model_dir, "bfloat16").fingerprint
    assert model_fingerprint(model_dir, "bfloat16") != loaded.fingerprint
    ids = list(range(3, 3 + 5 * BLOCK))
    assert hash_blocks(ids, BLOCK, HashKeys(model_fingerprint(model_dir), b"\x01")) == \
        hash_blocks(ids, BLOCK, HashKeys(loaded.fingerprint, b"\x01"))


def test_no_weights_no_fingerprint(tmp_path: Path):
    from kvmesh.engine.checkpoint_error import CheckpointError

    model_dir = write_preset(tmp_path / "m", "tiny", "llama", seed=3)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError):  # the ingress then routes by load only (service._prefix_locator)
        model_fingerprint(model_dir)


def test_prefix_holder_names_the_worker_a_spilled_prefill_fetches_from():
    table = table_of({"p1": 0, "p2": 0})
    router = Router.of(table, IngressSettings(load_bound=1.5))
    reply = LookupReply(workers=[WorkerMatch(worker="p1", blocks=40, runs=[TierRun(tier=Tier.L2, blocks=40)]),
                                 WorkerMatch(worker="p2", blocks=3, runs=[TierRun(tier=Tier.L1, blocks=3)])],
                        l3_blocks=0, indexed_blocks=40, ready=True)
    while (w := router.pick_prefill(40 * BLOCK, BLOCK, reply)) == "p1":  # the holder fills up ...
        table.acquire(w)
    assert w == "p2" and router.prefix_holder(reply, w) == "p1"  # ... the spill fetches from it
    assert router.prefix_holder(reply, "p1") is None  # the holder itself needs no peer
    assert router.prefix_holder(reply, "p2", exclude=("p1",)) is None  # a failed holder is not named again
    assert router.prefix_holder(None, "p2") is None


def test_prefix_holder_is_a_live_worker_of_any_role_with_a_longer_run():
    table = table_of({"p1": 0})
    router = Router.of(table, IngressSettings())
    hb = Heartbeat(worker_id="d1", role=Role.DECODE, load=0, capacity=8, started_at=datetime.now(UTC),
                   http_endpoint="http://127.0.0.1:1", seq=0, ttl_s=2)
    table.apply(WorkerChange(Change.UP, "d1", hb))
    reply = LookupReply(workers=[WorkerMatch(worker="gone", blocks=50, runs=[TierRun(tier=Tier.L1, blocks=50)]),
                                 WorkerMatch(worker="d1", blocks=20, runs=[TierRun(tier=Tier.L2, blocks=20)]),
                                 WorkerMatch(worker="p1", blocks=20, runs=[TierRun(tier=Tier.L1, blocks=20)])],
                        l3_blocks=60, indexed_blocks=60, ready=True)
    assert router.prefix_holder(reply, "p1") is None  # d1's run is no longer than p1's own; "gone" is not live
    assert router.prefix_holder(held_by("d1", 21, Tier.L2), "p1") == "d1"


def test_a_large_fleet_prices_a_sample_but_never_misses_a_holder_or_the_bound():
    loads = {f"p{i:04d}": float(i % 4) for i in range(1000)}
    table = table_of(loads)
    router = Router.of(table, IngressSettings(load_bound=1.5))
    assert router.pick_prefill(40 * BLOCK, BLOCK, held_by("p0997", 40)) == "p0997"  # load 1, but holds the prompt
    cold = LookupReply(workers=[], l3_blocks=0, indexed_blocks=0, ready=True)
    picks = [router.pick_prefill(40 * BLOCK, BLOCK, cold) for _ in range(200)]
    assert all(loads[w] == 0.0 for w in picks)  # a sample of 32 has an idle worker (3/4 busy: miss p = 1e-4)
    for _ in range(3000):  # requests that stay in flight: the bounded-load cap spreads them over the fleet
        table.acquire(router.pick_prefill(40 * BLOCK, BLOCK, cold))
    queued = [table.view(w).queued() for w in loads]
    total = sum(queued)
    assert max(queued) <= math.ceil(1.5 * total / len(loads)) + 1


def test_affinity_home_is_cached_until_the_membership_moves():
    table = table_of({f"p{i}": 0.0 for i in range(200)})
    router = Router.of(table, IngressSettings())
    key = "sess-1"
    first = home(key, table.live(Role.PREFILL))
    cold = LookupReply(workers=[], l3_blocks=0, indexed_blocks=0, ready=True)
    assert router.pick_prefill(4 * BLOCK, BLOCK, cold, affinity_key=key) == first
    table.apply(WorkerChange(Change.DOWN, first, None))  # its home leaves: the key moves to the next winner
    assert router.pick_prefill(4 * BLOCK, BLOCK, cold, affinity_key=key) == home(key, table.live(Role.PREFILL))
    second = home(key, table.live(Role.PREFILL))
    rest = [w for w in table.live(Role.PREFILL) if w != second]
    assert router.pick_prefill(4 * BLOCK, BLOCK, cold, affinity_key=key, exclude=[second]) == home(key, rest)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["up", "down", "beat", "acquire", "release"]), st.integers(0, 5),
                          st.sampled_from([Role.PREFILL, Role.DECODE]), st.integers(0, 8)), max_size=60))
def test_queued_total_is_the_sum_over_live_workers(ops):
    table = WorkerTable()
    for op, i, role, load in ops:
        w = f"w{i}"
        hb = Heartbeat(worker_id=w, role=role, load=load, capacity=8, started_at=datetime.now(UTC),
                       http_endpoint="http://127.0.0.1:1", seq=0, ttl_s=2)
        if op == "down":
            table.apply(WorkerChange(Change.DOWN, w, None))
        elif op in ("up", "beat"):
            table.apply(WorkerChange(Change.UP if op == "up" else Change.UPDATE, w, hb))
        else:
            (table.acquire if op == "acquire" else table.release)(w)
        for r in (Role.PREFILL, Role.DECODE):
            expected = sum(table.view(x).queued() for x in table.live(r))
            assert table.queued_total(r) == pytest.approx(expected)
