"""Imported blocks under a lease survive eviction pressure until their request runs, and no longer."""

from __future__ import annotations

import pytest
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.sampling import SamplingParams

BS = 4
POOL = 12
PARAMS = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
PROMPT = list(range(50, 50 + 4 * BS + 1))  # 4 usable full blocks
CHUNKS = 4


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    return load_model(tiny_model_dir)


def _engine(loaded: LoadedModel, num_blocks: int = POOL) -> Engine:
    # LRU: these tests check what a lease holds, not how a policy ranks (the default policy's doorkeeper
    # would keep the twice-requested prompt over the churn's one-off blocks, leased or not)
    return Engine(loaded, EngineSettings(block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=64,
                                         eviction_policy="lru"))


def _run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams = PARAMS):
    engine.add_request(rid, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def _churn(engine: Engine, base: int) -> None:
    """Two requests that each need every block not leased (8 of 12): whatever is evictable goes."""
    for i in range(2):
        _run(engine, f"churn{base}-{i}", [base + i] * (8 * BS - 1))


@pytest.fixture(scope="module")
def exported(loaded):
    src = _engine(loaded, 64)
    want = _run(src, "src", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False)).token_ids
    blocks = src.export_blocks(src.block_hashes(PROMPT))[:CHUNKS]
    assert len(blocks) == CHUNKS
    return blocks, want


def test_unleased_import_is_evicted_by_pressure(loaded, exported):
    """The control: without a lease the same pressure takes the imported blocks."""
    blocks, _ = exported
    engine = _engine(loaded)
    assert engine.import_blocks(blocks) == CHUNKS
    _churn(engine, 300)
    assert engine.cached_prefix_tokens(PROMPT) < CHUNKS * BS


def test_leased_import_survives_pressure_and_its_request_hits(loaded, exported):
    blocks, want = exported
    engine = _engine(loaded)
    assert engine.import_blocks(blocks, lease="req") == CHUNKS
    assert engine.leases.held("req") == CHUNKS
    _churn(engine, 300)
    assert engine.cached_prefix_tokens(PROMPT) == CHUNKS * BS
    # Another import needing more blocks than are free takes what fits, never a leased block.
    other = _engine(loaded, 64)
    _run(other, "o", list(range(600, 600 + 10 * BS + 1)))
    other_chain = other.export_blocks(other.block_hashes(list(range(600, 600 + 10 * BS))))
    assert engine.import_blocks(other_chain) == POOL - CHUNKS
    assert engine.cached_prefix_tokens(PROMPT) == CHUNKS * BS

    out = _run(engine, "req", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False))
    assert out.cached_tokens == CHUNKS * BS and out.token_ids == want
    assert "req" not in engine.leases  # ended with its request
    _churn(engine, 310)
    assert engine.cached_prefix_tokens(PROMPT) < CHUNKS * BS  # evictable again


def test_lease_ends_on_abort_and_on_release(loaded, exported):
    blocks, _ = exported
    engine = _engine(loaded)
    engine.import_blocks(blocks[:2], lease="a")
    engine.import_blocks(blocks[2:], lease="a")  # a later window of the same chain joins the lease
    assert engine.leases.held("a") == CHUNKS
    engine.add_request("a", PROMPT, PARAMS)
    assert engine.release_lease("a") == 0  # the request owns it now
    engine.abort("a")
    assert "a" not in engine.leases
    _churn(engine, 300)
    assert engine.cached_prefix_tokens(PROMPT) < CHUNKS * BS

    engine.import_blocks(blocks, lease="never-added")
    assert engine.lease_cached("never-added", engine.block_hashes(PROMPT)) == CHUNKS  # held once, not twice
    assert engine.release_lease("never-added") == CHUNKS
    assert engine.cache.num_evictable >= CHUNKS


def test_scheduler_breaks_leases_rather_than_stall(loaded, exported):
    """Leases that leave too little pool for the next request while nothing runs are broken, newest first."""
    blocks, _ = exported
    engine = _engine(loaded)
    engine.import_blocks(blocks, lease="stale")
    out = _run(engine, "big", list(range(700, 700 + 10 * BS)))  # needs 10 of 12 blocks, 8 are free
    assert out.finished and "stale" not in engine.leases
    assert engine.scheduler.num_broken_leases == 1
