"""The advisor's marks: a block advised to leave is not advised twice, and counts again once it left and came back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.registry import get_policy
from kvmesh.config import EvictionSettings
from kvmesh.eviction.advisor import Advisor
from kvmesh.eviction.messages import Demote, WorkerCommand
from kvmesh.eviction.occupancy import OccupancyView
from kvmesh.eviction.pins import PinTable
from kvmesh.kv_events.events import BlockMoved, BlockStored, KVEvent, KVEventBatch
from kvmesh.protocol.blocks import Tier

from .helpers import chain

CAP = 10
SETTINGS = EvictionSettings(policy="lru", high_water=0.9, low_water=0.5, readvise_s=30.0)


class Worker:
    """One worker's L1 as its events report it to the view; `follow` acts on advice like a real pool."""

    def __init__(self, view: OccupancyView) -> None:
        self.view, self.seq, self.l1 = view, 0, set[bytes]()

    def _send(self, ev: KVEvent, now: float) -> None:
        self.view.apply(KVEventBatch(worker="w", epoch=1, events=[ev]), now)

    def store(self, hashes: list[bytes], now: float) -> None:
        new = [h for h in hashes if h not in self.l1]
        if new:
            self.seq += 1
            self._send(BlockStored(seq=self.seq, hashes=[h.hex() for h in new], tokens_per_block=16, tier=Tier.L1),
                       now)
            self.l1.update(new)

    def follow(self, commands: list[WorkerCommand], now: float) -> list[bytes]:
        gone = [h for c in commands if isinstance(c.command, Demote)
                for h in map(bytes.fromhex, c.command.hashes) if h in self.l1]
        if gone:
            self.seq += 1
            self._send(BlockMoved(seq=self.seq, hashes=[h.hex() for h in gone], src=Tier.L1, dst=Tier.L2), now)
            self.l1.difference_update(gone)
        return gone


def advisor() -> tuple[Advisor, Worker]:
    view = OccupancyView()
    return Advisor(view, PinTable(), get_policy("lru"), SETTINGS, CAP), Worker(view)


def advised(commands: list[WorkerCommand]) -> list[bytes]:
    return [h for c in commands for h in map(bytes.fromhex, c.command.hashes)]


def test_advice_the_worker_has_not_acted_on_is_not_repeated_until_readvise_s() -> None:
    adv, w = advisor()
    w.store(chain(10, "a"), now=0.0)
    first = advised(adv.advise(1.0))
    assert len(first) == 10 - 5  # down to the low watermark
    assert adv.advise(2.0) == [] and adv.advise(30.9) == []  # still in L1: the worker has not acted yet
    assert sorted(advised(adv.advise(31.0))) == sorted(first)  # ignored for readvise_s: said again


def test_a_block_that_left_and_came_back_counts_again() -> None:
    adv, w = advisor()
    a = chain(10, "a")
    w.store(a, now=0.0)
    first = adv.advise(1.0)
    assert len(w.follow(first, now=1.1)) == 5
    w.store(a, now=1.2)  # the next turn recomputed the chain: the demoted tail is back in L1
    again = adv.advise(2.0)  # well inside readvise_s: the returned copies are new arrivals, not advised ones
    assert sorted(advised(again)) == sorted(advised(first))
    assert {c.command_id for c in again}.isdisjoint(c.command_id for c in first)  # not deduplicated away


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "follow", "advise"]), st.integers(0, 3), st.integers(1, 8)),
                min_size=1, max_size=40))
def test_after_each_advice_what_is_held_and_not_pending_is_under_the_high_watermark(steps) -> None:
    """A model of the advice outstanding (advised, still in L1, the worker yet to act): after every `advise`,
    L1 less that is at most the high watermark; every mark is a block the view holds in L1."""
    adv, w = advisor()
    chains = [chain(8, f"c{k}") for k in range(4)]
    pending: set[bytes] = set()
    latest: list[WorkerCommand] = []
    now = 0.0
    for op, k, n in steps:
        now += 0.1  # all inside one readvise_s: nothing is advised twice for having been ignored
        if op == "store":
            w.store(chains[k][:n], now)
        elif op == "follow":
            pending -= set(w.follow(latest, now))
            latest = []
        else:
            latest = adv.advise(now)
            got = advised(latest)
            assert pending.isdisjoint(got), "advised again before the worker acted"
            pending.update(got)
            assert len(w.l1 - pending) <= SETTINGS.high_water * CAP
        occ = adv.view.workers.get("w")
        marks = {h for (tier, h) in occ.advised} if occ is not None else set()
        assert marks <= w.l1 and pending & w.l1 <= marks
