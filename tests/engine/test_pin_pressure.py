"""Pins are advice under pressure: a request that needs the pool takes pinned-but-idle blocks, never waits.

Before this, a pool whose pins (within engine.pin_fraction) plus one long prompt exceeded the pool
stalled: nothing ran, the head of the queue could not be admitted, and nothing would ever free a
block (the live `kvmesh bench agents --l1-blocks 1536` stall of issue 12). A stall shows here as
steps that report nothing: the loops below give up after a fixed number of steps, far more than
the request needs, so the old code fails instead of hanging.
"""

from __future__ import annotations

import time

import pytest
from engine.test_pins import cached_chain
from engine.test_prefix_cache import make_cache
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.pins import PinSet
from kvmesh.engine.sampling import SamplingParams
from kvmesh.serving.tier_metrics import EnginePressureCollector
from prometheus_client import CollectorRegistry

BS = 4
POOL = 12  # pin budget: 6 blocks (engine.pin_fraction 0.5)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False)
BIG = list(range(300, 300 + 10 * BS - 2))  # 10 blocks (prompt and the outputs it computes): more than 12 less 6 pinned
MAX_STEPS = 200  # the big request needs about a dozen steps


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    return load_model(tiny_model_dir)


def _engine(loaded: LoadedModel, chunk_tokens: int = 64) -> Engine:
    return Engine(loaded, EngineSettings(block_size=BS, num_blocks=POOL, max_num_batched_tokens=chunk_tokens))


def _run(engine: Engine, rid: str, prompt: list[int]):
    engine.add_request(rid, prompt, PARAMS)
    for _ in range(MAX_STEPS):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    s = engine.scheduler
    pytest.fail(f"{rid} stalled: {len(s.running)} running, {len(s.waiting)} waiting, "
                f"{engine.cache.num_allocatable} of {POOL} blocks allocatable, {len(engine.pins)} pinned")


def _pin_chain(engine: Engine, first: int, n_blocks: int, ttl_s: float = 3600.0) -> list[bytes]:
    """Compute a chain of `n_blocks` (a finished turn) and pin it for `ttl_s`."""
    prompt = list(range(first, first + n_blocks * BS + 1))
    _run(engine, f"turn-{first}", prompt)
    hashes = engine.block_hashes(prompt)[:n_blocks]
    assert engine.pin(hashes, time.time() + ttl_s) == n_blocks
    return hashes


@pytest.fixture(scope="module")
def expected(loaded) -> list[int]:
    """BIG's tokens on a pool nobody pins."""
    return _run(_engine(loaded), "big", BIG).token_ids


@pytest.mark.parametrize("chunk_tokens", [64, 8], ids=["one-chunk", "chunked"])
def test_a_prompt_that_needs_the_pool_takes_idle_pinned_blocks(loaded, expected, chunk_tokens):
    """6 of 12 blocks pinned for an hour; BIG needs 10. It completes with the tokens it has unpinned,
    by dropping just enough pins (counted); chunked, it does so while it runs instead of preempting itself."""
    engine = _engine(loaded, chunk_tokens)
    _pin_chain(engine, 100, 6)
    assert len(engine.pins) == 6 and engine.cache.num_allocatable == POOL - 6
    out = _run(engine, "big", BIG)
    assert out.token_ids == expected
    assert engine.pins.num_yielded == 4 and len(engine.pins) == len(engine.pins.ledger) == 2
    assert engine.scheduler.num_preemptions == 0
    registry = CollectorRegistry()
    registry.register(EnginePressureCollector(engine))  # what a worker's /metrics shows
    assert registry.get_sample_value("kvmesh_l1_pins_yielded_blocks_total") == 4


def test_the_requests_own_pinned_prefix_stays_pinned_and_hits(loaded, expected):
    """BIG's first 3 blocks are pinned (its session's last turn) and so is another chain: the other
    chain's pins go, BIG's own prefix is kept, hit and still pinned afterwards."""
    engine = _engine(loaded)
    own = _pin_chain(engine, 300, 3)  # BIG starts with range(300, ...): the same blocks
    other = _pin_chain(engine, 500, 3)
    out = _run(engine, "big", BIG)
    assert out.token_ids == expected
    assert out.cached_tokens == 3 * BS
    assert all(h in engine.pins for h in own)
    assert engine.pins.num_yielded == 1 and sum(h in engine.pins for h in other) == 2


def test_pins_and_leases_together_never_stall(loaded, expected):
    """A stale lease and pins fill the pool while nothing runs: pins go first, then the lease; BIG runs."""
    engine = _engine(loaded)
    _pin_chain(engine, 100, 6)
    prompt = list(range(700, 700 + 4 * BS + 1))
    _run(engine, "lease-src", prompt)
    assert engine.lease_cached("stale", engine.block_hashes(prompt)[:4]) == 4
    assert engine.cache.num_allocatable == POOL - 10
    out = _run(engine, "big", BIG)
    assert out.token_ids == expected
    assert engine.pins.num_yielded == 6 and engine.scheduler.num_broken_leases == 1


def test_yield_idle_drops_the_furthest_deadline_first_tail_first() -> None:
    """Unit view of the order: the pin expected back last goes first, a chain's tail before its start;
    blocks that something else holds, or that the caller keeps, are never unpinned."""
    cache = make_cache(32)
    pins = PinSet(cache, limit=16)
    soon, late, held = cached_chain(cache, 4, 1), cached_chain(cache, 4, 2), cached_chain(cache, 2, 3)
    pins.pin_for("", soon, until=100, now=0)
    pins.pin_for("", late, until=200, now=0)
    pins.pin_for("", held, until=300, now=0)
    for h in held:
        cache.acquire(cache.get(h))  # a running request uses these
    before = cache.num_evictable
    keep = frozenset({cache.get(late[0]).block_id})
    assert pins.yield_idle(4, keep) == 4
    assert [h in pins for h in late] == [True, False, False, False]
    assert [h in pins for h in soon] == [True, True, True, False]
    assert all(h in pins for h in held)
    assert cache.num_evictable == before + 4 and pins.num_yielded == 4 and len(pins.ledger) == len(pins) == 6
    assert pins.yield_idle(10) == 4  # soon's last three and late's first: held stays
    assert len(pins) == 2 and all(h in pins for h in held)


def test_a_request_that_can_never_fit_is_refused_at_once(loaded):
    """More blocks than the whole pool (prompt + max_tokens): a clear error when added, never a queued wait."""
    engine = _engine(loaded)
    with pytest.raises(ValueError, match="more KV blocks than the pool"):
        engine.add_request("huge", list(range(100, 100 + POOL * BS)), PARAMS)
    assert not engine.has_unfinished()
