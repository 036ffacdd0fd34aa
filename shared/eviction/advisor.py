"""From the occupancy view to commands: which worker should demote what, now.

`Advisor.advise(now)` runs `plan_demotion` for every worker's L1 and L2
against that worker's capacities (from its heartbeat, else `l1_capacity` and
`settings.l2_capacity_blocks`) and returns the `WorkerCommand`s to send. A block
advised to leave counts as gone until the worker's events say it left (the
mark, `WorkerOccupancy.advised`), so one over-full tier is not advised twice;
a worker that never acts on it is advised again after `readvise_s`. A block
that left and was stored there again is held afresh and counts. Protected:
pinned blocks; in L2 also blocks without an L3 copy (dropping them there
would lose them).
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash
from kvmesh.cache_policy.base import EvictionPolicy
from kvmesh.config import EvictionSettings
from kvmesh.eviction.decisions import Watermarks, plan_demotion
from kvmesh.eviction.messages import Demote, WorkerCommand
from kvmesh.eviction.occupancy import OccupancyView
from kvmesh.eviction.pins import PinTable
from kvmesh.protocol.blocks import Tier


@dataclass(slots=True)
class Advisor:
    view: OccupancyView
    pins: PinTable
    policy: EvictionPolicy
    settings: EvictionSettings
    l1_capacity: int

    def advise(self, now: float) -> list[WorkerCommand]:
        s = self.settings
        marks = Watermarks(s.high_water, s.low_water)
        out: list[WorkerCommand] = []
        defaults = {Tier.L1: self.l1_capacity, Tier.L2: s.l2_capacity_blocks}
        for worker, occ in list(self.view.workers.items()):
            if occ.advised:
                occ.advised = {k: t for k, t in occ.advised.items() if now - t < s.readvise_s}
            for tier, default in defaults.items():
                cap = self.view.capacity(worker, tier, default)
                if not cap:
                    continue
                blocks = {h: i for h, i in self.view.blocks(worker, tier).items() if (tier, h) not in occ.advised}

                def protected(h: bytes, tier: Tier = tier) -> bool:
                    return self.pins.pinned(h, now) or (tier is Tier.L2 and h not in self.view.l3)
                victims = plan_demotion(blocks, cap, marks, self.policy, now, protected)
                for k in range(0, len(victims), s.max_hashes_per_command):
                    part = victims[k:k + s.max_hashes_per_command]
                    out.append(self._command(worker, tier, part, now))
                for h in victims:
                    occ.advised[(tier, h)] = now
        return out

    def _command(self, worker: str, tier: Tier, hashes: list[bytes], now: float) -> WorkerCommand:
        # One id per decision (content and the tick's time): the publisher's retries of it are
        # deduplicated; the same blocks advised again later (back after leaving, or ignored) are not.
        digest = xxhash.xxh3_64_hexdigest(b"".join(hashes))
        cid = f"demote-{worker}-{tier.value}-{digest}-{int(now * 1000)}"
        return WorkerCommand(worker=worker, command_id=cid,
                             command=Demote(hashes=[h.hex() for h in hashes], src=tier))
