"""The prefill cost function: monotone in cached blocks and in load (hypothesis), and where blocks come from."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from kvmesh.cache_index.messages import LookupReply, TierRun, WorkerMatch
from kvmesh.ingress.routing.cost import (
    FetchCosts,
    Placement,
    Placements,
    placement,
    prefill_cost,
)
from kvmesh.protocol.blocks import Tier

BLOCK = 16
rates = st.floats(min_value=1e-6, max_value=1e-2)
fetch = st.builds(FetchCosts, st.floats(0, 0.1), st.floats(0, 0.1), st.floats(0, 0.1), st.floats(0, 1.0))
counts = st.integers(0, 40)
TIERS = ("l1", "l2", "peer", "l3")


@given(prompt=st.integers(1, 800), l1=counts, l2=counts, peer=counts, l3=counts, tier=st.sampled_from(TIERS),
       rate=rates, queued=st.floats(0, 50), costs=fetch)
def test_one_more_cached_block_never_costs_more(prompt, l1, l2, peer, l3, tier, rate, queued, costs):
    before = Placement(l1, l2, peer, l3)
    after = Placement(**{t: getattr(before, t) + (t == tier) for t in TIERS})
    assert prefill_cost(prompt, BLOCK, after, rate, queued, costs) <= prefill_cost(prompt, BLOCK, before, rate,
                                                                                   queued, costs) + 1e-12


@given(prompt=st.integers(1, 800), l1=counts, l2=counts, rate=rates, queued=st.floats(0, 50),
       more=st.floats(0, 50), costs=fetch)
def test_more_load_never_costs_less(prompt, l1, l2, rate, queued, more, costs):
    where = Placement(l1, l2)
    assert prefill_cost(prompt, BLOCK, where, rate, queued + more, costs) >= prefill_cost(prompt, BLOCK, where, rate,
                                                                                          queued, costs)


@given(prompt=st.integers(BLOCK, 800), rate=rates, costs=fetch)
def test_a_block_in_l1_is_free_and_a_fetch_never_costs_more_than_recompute(prompt, rate, costs):
    blocks = prompt // BLOCK
    cold = prefill_cost(prompt, BLOCK, Placement(), rate, 0, costs)
    assert abs(cold - prompt * rate) < 1e-9
    hot = prefill_cost(prompt, BLOCK, Placement(l1=blocks), rate, 0, costs)
    assert abs(hot - (prompt - blocks * BLOCK) * rate) < 1e-9
    assert prefill_cost(prompt, BLOCK, Placement(l3=blocks), rate, 0, costs) <= cold + 1e-12


def test_placement_own_tiers_then_peer_then_l3():
    reply = LookupReply(workers=[
        WorkerMatch(worker="p1", blocks=6, runs=[TierRun(tier=Tier.L1, blocks=4), TierRun(tier=Tier.L2, blocks=2)]),
        WorkerMatch(worker="p2", blocks=2, runs=[TierRun(tier=Tier.L2, blocks=2)]),
    ], l3_blocks=8, indexed_blocks=100, ready=True)
    assert placement(reply, "p1", 10) == Placement(l1=4, l2=2, peer=0, l3=2)
    assert placement(reply, "p2", 10) == Placement(l1=0, l2=2, peer=4, l3=2)
    assert placement(reply, "p3", 10) == Placement(l1=0, l2=0, peer=6, l3=2)
    assert placement(reply, "p3", 5) == Placement(peer=5)  # never more than the prompt's blocks
    assert placement(None, "p1", 10) == Placement()


def _scan(reply: LookupReply, worker: str, total: int) -> Placement:
    """The definition, one worker at a time: its own run, the best other holder's run, then L3."""
    own = next((m for m in reply.workers if m.worker == worker), None)
    l1 = own.runs[0].blocks if own and own.runs and own.runs[0].tier is Tier.L1 else 0
    have = own.blocks if own else 0
    best_peer = max((m.blocks for m in reply.workers if m.worker != worker), default=0)
    peer = max(0, min(best_peer, total) - have)
    return Placement(l1=l1, l2=have - l1, peer=peer, l3=max(0, min(reply.l3_blocks, total) - have - peer))


@given(runs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=8), l3=counts, total=counts)
def test_placements_of_every_worker_equal_the_per_worker_scan(runs, l3, total):
    matches = [WorkerMatch(worker=f"p{i}", blocks=a + b,
                           runs=[TierRun(tier=t, blocks=n) for t, n in ((Tier.L1, a), (Tier.L2, b)) if n])
               for i, (a, b) in enumerate(runs) if a + b]
    reply = LookupReply(workers=matches, l3_blocks=l3, indexed_blocks=100, ready=True)
    where = Placements(reply)
    for worker in [m.worker for m in matches] + ["elsewhere"]:
        assert where.of(worker, total) == _scan(reply, worker, total)
