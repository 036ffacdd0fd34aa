"""Scheduler logic without a model: budgets, decode priority, chunking, preemption."""

from __future__ import annotations

from kvmesh.config import EngineSettings
from kvmesh.engine.block_pool import BlockPool
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.scheduler import Scheduler
from kvmesh.protocol.block_hash import HashKeys

BS = 4


def make(num_blocks: int = 64, budget: int = 16, max_seqs: int = 8) -> Scheduler:
    settings = EngineSettings(block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(settings, PrefixCache(BlockPool(num_blocks), BS))


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens), HashKeys("fp"), BS, 0.0)


def step(s: Scheduler, next_token: int = 7) -> dict[str, int]:
    """One step as the engine runs it, with a fixed token in place of sampling."""
    scheduled = s.schedule()
    s.commit(scheduled)
    for x in scheduled:
        if x.sample:
            x.request.append_token(next_token)
    return {x.request.request_id: x.num_new for x in scheduled}


def test_budget_is_respected_and_prefill_is_chunked() -> None:
    s = make(budget=16)
    for i in range(3):
        s.add(req(f"r{i}", [i * 100 + j for j in range(30)]))
    for _ in range(12):
        planned = step(s)
        assert sum(planned.values()) <= 16
    assert all(r.num_output_tokens > 0 for r in s.running)


def test_decodes_are_not_starved_by_a_long_prefill() -> None:
    s = make(budget=16)
    a = req("a", list(range(10)))
    s.add(a)
    step(s)
    assert a.num_output_tokens == 1
    s.add(req("b", list(range(100, 200))))
    for _ in range(5):
        planned = step(s)
        assert planned["a"] == 1 and planned["b"] == 15


def test_max_num_seqs_caps_running() -> None:
    s = make(budget=64, max_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", [i] * 5))
    step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_prefix_hit_skips_cached_tokens_but_computes_the_last_one() -> None:
    s = make(budget=64)
    a = req("a", list(range(12)))
    s.add(a)
    step(s)
    s.remove(a)
    b = req("b", list(range(12)))  # identical: 3 full cached blocks
    s.add(b)
    planned = step(s)
    assert b.cached_tokens == 8 and planned["b"] == 4  # last block recomputed for logits
    c = req("c", list(range(10)) + [55, 56])
    s.add(c)
    planned = step(s)
    assert c.cached_tokens == 8 and planned["c"] == 4


def test_preemption_takes_the_newest_and_its_blocks_stay_cached() -> None:
    s = make(num_blocks=8, budget=64)
    old, new = req("old", list(range(12)), 20), req("new", list(range(50, 62)), 20)
    s.add(old)
    s.add(new)
    step(s)  # both prefilled: 4 blocks each
    assert len(s.running) == 2
    preempted = False
    for _ in range(6):
        step(s)
        if new.status is RequestStatus.WAITING:
            preempted = True
            break
    assert preempted and old.status is RequestStatus.RUNNING and s.num_preemptions >= 1
    assert new.blocks == [] and new.num_computed == 0
    assert len(s.cache.lookup(new.block_hashes, new.token_ids)) == 3  # its full blocks stay cached
    s.remove(old)
    planned = step(s)
    assert new.status is RequestStatus.RUNNING
    # Recompute of prompt + output mostly hit; the new token sampled this step is not computed yet.
    assert new.num_computed == new.num_tokens - 1 and planned["new"] <= 2 * BS


def test_budget_and_accounting_under_pressure() -> None:
    s = make(num_blocks=12, budget=8, max_seqs=4)
    reqs = [req(f"r{i}", [i * 7 + j for j in range(9)], max_tokens=12) for i in range(5)]
    for r in reqs:
        s.add(r)
    for _ in range(200):
        if not s.has_unfinished():
            break
        planned = step(s)
        assert sum(planned.values()) <= 8
        for r in list(s.running):
            assert len(r.blocks) * BS >= r.num_computed
            if r.num_output_tokens >= r.params.max_tokens:
                s.remove(r)
        in_use = {b.block_id for r in s.running for b in r.blocks}
        assert len(in_use) + s.cache.num_allocatable == 12
    assert not s.has_unfinished()
    assert all(r.num_output_tokens == 12 for r in reqs)
