"""The connector in vLLM's scheduler: how many tokens kvmesh can supply, and which blocks to load and keep.

For a request vLLM is about to admit, `matched` hashes its tokens the kvmesh
way and asks the store view how far the chain is held (the worker's L2, the
L2 slabs of the peers it knows or the request names, then L3). It offers
whole blocks past vLLM's own prefix hit, never the last token (vLLM must
compute at least one). The lookup is synchronous: an L2 probe is
a read of shared memory, an L3 probe one HEAD per chunk (none for chunks the
view already saw), and a request asked about again while it waits for room
gets the answer it got before.

Once vLLM has allocated the request's blocks, the load is planned onto them.
Every step then plans to keep each block that became full and computed in
that step, prompt and output alike: an agent's next turn re-sends this turn's
answer too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.connectors.vllm.plan import LoadPlan, SavePlan, StepPlan
from kvmesh.connectors.vllm.request_peers import request_peers
from kvmesh.connectors.vllm.store import Reach, StoreView
from kvmesh.log import get_logger
from kvmesh.protocol.vllm_identity import chain_hashes, tenant_salt_hex

log = get_logger(__name__)


@dataclass
class Tracked:
    """A request the scheduler's connector follows: its vLLM blocks and how far its chain is kept."""

    request: object  # vllm.v1.request.Request (live: its tokens grow as it decodes)
    salt_hex: str
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # the chain of its full blocks, as far as hashed
    kept: int = 0  # positions 0.. already planned to be kept (or loaded from kvmesh)


@dataclass
class SchedulerSide:
    view: StoreView
    fingerprint: str
    block_size: int
    tracked: dict[str, Tracked] = field(default_factory=dict)
    _loads: list[LoadPlan] = field(default_factory=list)
    _offers: dict[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)  # request -> (first offered, peers)
    _seen: dict[str, tuple[int, Reach]] = field(default_factory=dict)  # request -> (loadable blocks, its reach)
    lookups: int = 0
    offered_tokens: int = 0

    def matched(self, request, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (vLLM's own hit, block-aligned) that kvmesh can load."""
        tokens = list(request.all_token_ids)
        loadable = (len(tokens) - 1) // self.block_size  # whole blocks, leaving the last token to vLLM
        first = num_computed_tokens // self.block_size
        if loadable <= first:
            return 0
        peers = request_peers(getattr(request, "kv_transfer_params", None))
        seen = self._seen.get(request.request_id)
        if seen is not None and seen[0] == loadable:  # asked again while it waits for room: same answer
            reach = seen[1]
        else:
            salt = tenant_salt_hex(getattr(request, "cache_salt", None))
            hashes = chain_hashes(tokens[:loadable * self.block_size], self.block_size, self.fingerprint, salt)
            reach = self.view.reach(salt, hashes, peers)
            self._seen[request.request_id] = (loadable, reach)
            self.lookups += 1
        if reach.total <= first:
            self._offers.pop(request.request_id, None)
            return 0
        self._offers[request.request_id] = (first, peers)
        return (reach.total - first) * self.block_size

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave the request `block_ids` (all of its blocks); plan the load it was offered."""
        t = self._track(request)
        t.block_ids = list(block_ids)
        self._seen.pop(request.request_id, None)
        offer = self._offers.pop(request.request_id, None)
        if num_external_tokens <= 0 or offer is None:
            return
        first, peers = offer
        end = first + num_external_tokens // self.block_size
        self._extend_hashes(t, end)
        self._loads.append(LoadPlan(request.request_id, t.salt_hex, t.hashes[:end], first, t.block_ids[first:end],
                                    peers))
        self.offered_tokens += num_external_tokens

    def step(self, scheduler_output) -> StepPlan:
        """This step's loads, and the blocks each scheduled request fills in it."""
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.tracked:
                self.tracked[new.req_id].block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            t = self.tracked.get(req_id)
            ids = cached.new_block_ids[i]
            if t is None or ids is None:
                continue
            if req_id in resumed:  # after a preemption: the full list, and everything is computed again
                t.block_ids, t.kept = list(ids[0]), 0
            else:
                t.block_ids += ids[0]
        plan = StepPlan(loads=self._loads)
        self._loads = []
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            t = self.tracked.get(req_id)
            if t is not None:
                save = self._save_plan(t, t.request.num_computed_tokens + scheduled)
                if save is not None:
                    plan.saves.append(save)
        return plan

    def finished(self, request) -> None:
        self.tracked.pop(request.request_id, None)
        self._offers.pop(request.request_id, None)
        self._seen.pop(request.request_id, None)

    def _track(self, request) -> Tracked:
        t = self.tracked.get(request.request_id)
        if t is None:
            t = Tracked(request, tenant_salt_hex(getattr(request, "cache_salt", None)))
            self.tracked[request.request_id] = t
        return t

    def _save_plan(self, t: Tracked, computed: int) -> SavePlan | None:
        full = min(computed, t.request.num_tokens, len(t.block_ids) * self.block_size) // self.block_size
        if full <= t.kept:  # most decode steps: no block filled, no copy of the tokens
            return None
        tokens = list(t.request.all_token_ids)
        self._extend_hashes(t, full, tokens)
        n = self.block_size
        plan = SavePlan(t.request.request_id, t.salt_hex, t.hashes[:full], t.kept, t.block_ids[t.kept:full],
                        [tuple(tokens[p * n:(p + 1) * n]) for p in range(t.kept, full)])
        t.kept = full
        return plan

    def _extend_hashes(self, t: Tracked, blocks: int, tokens: list[int] | None = None) -> None:
        if len(t.hashes) >= blocks:
            return
        tokens = list(t.request.all_token_ids) if tokens is None else tokens
        n, have = self.block_size, len(t.hashes)
        t.hashes += chain_hashes(tokens[have * n:blocks * n], n, self.fingerprint, t.salt_hex,
                                 t.hashes[-1] if t.hashes else None)
