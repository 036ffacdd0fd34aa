"""Which worker gets a request: least loaded, with affinity by cache key or session.

The live workers come from `WorkerTable` (workers.py). `Router.pick` scores a worker as
(heartbeat load + own in-flight) / capacity. With an affinity key it takes
the rendezvous-hash winner among live workers, so the same conversation
lands where its KV cache is and only keys of a departed worker move, unless
that worker is overloaded (score above `overload_factor`): then it falls
back to the least loaded, a guard against piling one hot key onto one worker.

Prefill with a cache-index answer (`pick_prefill`) minimises the cost of
shared/ingress/routing/cost.py (uncached tokens x measured rate + queue +
fetch), among workers under a bounded-load cap (`load_bound` x the average
load per worker, +1: consistent hashing with bounded loads), with the
affinity home's cost lowered by `affinity_bonus_s`. In a large fleet it prices
the workers holding part of the prompt, the affinity home and a random sample
of the rest (`sample_size`), and keeps what depends only on membership (live
lists, homes) until a worker comes or goes, so a pick does not grow with the
fleet. Decode goes by load.
When the chosen worker's own L1/L2 run is shorter than another live
worker's, `prefix_holder` names that worker: the PrefillJob carries it so
prefill fetches the rest over the network peer path (the cost credited it).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.cache_index.messages import LookupReply
from kvmesh.config import IngressSettings
from kvmesh.ingress.routing.cost import FetchCosts, Placements, prefill_cost
from kvmesh.ingress.routing.rates import PrefillRates
from kvmesh.ingress.routing.workers import WorkerTable
from kvmesh.log import get_logger
from kvmesh.protocol.messages import Role

log = get_logger(__name__)

HOME_CACHE = 65_536  # affinity keys whose home is kept (cleared whole when full, and on membership changes)


def _rendezvous(key: str, worker_id: str) -> bytes:
    return hashlib.sha256(f"{key}\x00{worker_id}".encode()).digest()


def home(key: str, workers: Iterable[str]) -> str:
    """The rendezvous-hash winner for `key` among `workers` (non-empty)."""
    return max(workers, key=lambda w: _rendezvous(key, w))


@dataclass(slots=True)
class Router:
    table: WorkerTable
    overload_factor: float = 2.0
    mode: str = "cost"  # IngressSettings.routing
    costs: FetchCosts = field(default_factory=FetchCosts)
    rates: PrefillRates = field(default_factory=PrefillRates)
    affinity_bonus_s: float = 0.02
    load_bound: float = 1.5
    sample_size: int = 32  # non-holders priced per prefill pick in a fleet larger than twice this
    _turns: dict[Role, int] = field(default_factory=dict)  # round_robin position per role
    _rng: random.Random = field(default_factory=lambda: random.Random(0))
    _homes: dict[tuple[Role, str], str] = field(default_factory=dict)  # (role, affinity key) -> home, at `_version`
    _version: int = -1

    @classmethod
    def of(cls, table: WorkerTable, s: IngressSettings) -> Router:
        return cls(table, s.worker_overload_factor, s.routing, FetchCosts.of(s),
                   PrefillRates(s.prefill_s_per_token, s.prefill_rate_alpha), s.affinity_bonus_s, s.load_bound)

    def pick(self, role: Role, affinity_key: str | None = None, exclude: Iterable[str] = ()) -> str | None:
        """A live worker of `role` not in `exclude` (or None); see the module docstring for the rule."""
        skip = set(exclude)
        live = self._live(role)
        candidates = [w for w in live if w not in skip]
        if not candidates:
            return None
        if self.mode == "round_robin":
            turn = self._turns[role] = self._turns.get(role, -1) + 1
            return candidates[turn % len(candidates)]
        views = {w: self.table.view(w) for w in candidates}
        if affinity_key:
            preferred = self._home(role, affinity_key, live, skip)
            view = views[preferred]
            if view is not None and view.score() <= self.overload_factor:
                return preferred
        return min(candidates, key=lambda w: (views[w].score() if views[w] else 0.0, w))

    def pick_prefill(self, prompt_tokens: int, block_size: int, reply: LookupReply | None,
                     affinity_key: str | None = None, exclude: Iterable[str] = ()) -> str | None:
        """The prefill worker of least cost under the load cap; by load (`pick`) without an index answer.

        In a fleet larger than 2 x `sample_size` the candidates are the workers holding part of the
        prompt, the affinity home and `sample_size` others drawn at random (the power of k choices:
        workers holding none of the prompt differ only in load and rate, and the best of a random 32
        is in the best few percent), so a pick costs O(holders + k), not O(fleet).
        """
        if reply is None or self.mode != "cost":
            return self.pick(Role.PREFILL, affinity_key, exclude)
        table, skip = self.table, set(exclude)
        live = self._live(Role.PREFILL)
        skipped = [v for w in skip if (v := table.view(w)) and v.heartbeat.role == Role.PREFILL]
        count = len(live) - len(skipped)
        if count <= 0:
            return None
        queued_total = table.queued_total(Role.PREFILL) - sum(v.queued() for v in skipped)
        cap = math.ceil(self.load_bound * (queued_total + 1) / count)
        preferred = self._home(Role.PREFILL, affinity_key, live, skip) if affinity_key else None
        where = Placements(reply)
        candidates = self._candidates(live, skip, reply, preferred)
        eligible = [w for w in candidates
                    if (v := table.view(w)).queued() + 1 <= cap and v.score() <= self.overload_factor]
        if not eligible:
            return min((w for w in live if w not in skip), key=lambda w: (table.view(w).score(), w))
        total_blocks = prompt_tokens // block_size
        # Workers holding none of the prompt share one placement, so most costs repeat:
        # they are computed once per (rate, load) and, with the rate, cost the same as `prefill_cost` says.
        priced: dict[tuple[float, float], float] = {}

        def cost(w: str) -> tuple[float, str]:
            rate, queued = self.rates.rate(w), table.view(w).queued()
            if where.holds(w):
                c = prefill_cost(prompt_tokens, block_size, where.of(w, total_blocks), rate, queued, self.costs)
            elif (c := priced.get((rate, queued))) is None:
                c = priced[(rate, queued)] = prefill_cost(prompt_tokens, block_size, where.of(w, total_blocks),
                                                          rate, queued, self.costs)
            return (c - (self.affinity_bonus_s if w == preferred else 0.0), w)

        best = min(eligible, key=cost)
        log.debug("prefill routed", worker=best, cost=round(cost(best)[0], 5), cap=cap, eligible=len(eligible),
                  holders=len(reply.workers), l3=reply.l3_blocks, blocks=total_blocks)
        return best

    def _candidates(self, live: list[str], skip: set[str], reply: LookupReply, preferred: str | None) -> list[str]:
        """Live prefill workers not in `skip` to price: all of them in a small fleet, else holders + home + a sample."""
        if len(live) <= 2 * self.sample_size:
            return [w for w in live if w not in skip]
        picked = set(self._rng.sample(live, self.sample_size))
        picked.update(m.worker for m in reply.workers)
        if preferred is not None:
            picked.add(preferred)
        return sorted(w for w in picked - skip if (v := self.table.view(w)) and v.heartbeat.role == Role.PREFILL)

    def _live(self, role: Role) -> list[str]:
        """`table.live_ids(role)`, first dropping what was keyed by an older membership."""
        if self._version != self.table.version:
            self.rates.forget(set(self.table.live_ids(Role.PREFILL)))
            self._homes.clear()
            self._version = self.table.version
        return self.table.live_ids(role)

    def _home(self, role: Role, key: str, live: list[str], skip: set[str]) -> str | None:
        """The rendezvous home of `key` among `live` workers of `role` not in `skip`; cached per membership
        (a home is 1,000 hashes at 1,000 workers)."""
        if skip:
            rest = [w for w in live if w not in skip]
            return home(key, rest) if rest else None
        if (found := self._homes.get((role, key))) is None:
            if len(self._homes) >= HOME_CACHE:
                self._homes.clear()
            found = self._homes[(role, key)] = home(key, live)
        return found

    def prefix_holder(self, reply: LookupReply | None, worker: str, exclude: Iterable[str] = ()) -> str | None:
        """The live worker (any role, not `worker`, not excluded) holding the longest leading run of the
        request in L1/L2, if that run is longer than `worker`'s own: where prefill should fetch from."""
        if reply is None:
            return None
        skip = set(exclude) | {worker}
        own = next((m.blocks for m in reply.workers if m.worker == worker), 0)
        holders = [m for m in reply.workers if m.worker not in skip and self.table.view(m.worker) is not None]
        best = max(holders, key=lambda m: m.blocks, default=None)  # first of equals: the reply's order
        return best.worker if best is not None and best.blocks > own else None
