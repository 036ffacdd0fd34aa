"""What a prefill costs on one worker, in seconds: the router's objective.

cost = uncached tokens x the worker's prefill rate (s/token)
     + queued requests x `queue_s_per_request`
     + fetching the cached part from where it lives.
Each block the worker does not hold in L1 is priced at the cheaper of
fetching it (own L2, a peer's L1/L2, L3: per-block constants in
`IngressSettings`) and recomputing it (block_size x rate). Because every
block costs at most its recompute price, more cached blocks never raise a
worker's cost, and more load never lowers it (tests/routing checks both).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.cache_index.messages import LookupReply, WorkerMatch
from kvmesh.config import IngressSettings
from kvmesh.protocol.blocks import Tier


@dataclass(frozen=True, slots=True)
class FetchCosts:
    """Seconds to bring one block into a worker's pool from each place it can be."""

    l2_s: float = 2e-4  # its own host memory
    peer_s: float = 2e-3  # another worker's L1/L2 (peer fetch)
    l3_s: float = 8e-3  # object storage
    queue_s_per_request: float = 0.05  # one request ahead of this one on the worker

    @classmethod
    def of(cls, s: IngressSettings) -> FetchCosts:
        return cls(s.fetch_l2_s_per_block, s.fetch_peer_s_per_block, s.fetch_l3_s_per_block, s.queue_s_per_request)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request's leading blocks are, seen from one worker (counts of blocks, chain order)."""

    l1: int = 0  # leading blocks in the worker's own pool
    l2: int = 0  # next blocks in its own host memory
    peer: int = 0  # next blocks a peer holds
    l3: int = 0  # next blocks in L3


class Placements:
    """`placement` for every worker of one lookup reply, each in O(1): the reply is indexed once (a reply
    may list every worker of the fleet, so a per-worker scan would make routing quadratic in fleet size)."""

    __slots__ = ("_by_worker", "_top", "_l3")

    def __init__(self, reply: LookupReply | None) -> None:
        workers = reply.workers if reply is not None else []
        self._by_worker = {m.worker: m for m in workers}
        self._top = sorted(workers, key=lambda m: m.blocks, reverse=True)[:2]  # best peer of anyone is one of these
        self._l3 = reply.l3_blocks if reply is not None else 0

    def holds(self, worker: str) -> bool:
        """Whether `worker` holds part of the prompt (every other worker's placement is the same)."""
        return worker in self._by_worker

    def of(self, worker: str, total_blocks: int) -> Placement:
        """Split the request's leading blocks by where `worker` would get them (own tiers, then peers, then L3)."""
        if not self._top and not self._l3:
            return Placement()
        l1, l2 = _own_tiers(self._by_worker.get(worker))
        have = l1 + l2
        best_peer = next((m.blocks for m in self._top if m.worker != worker), 0)
        peer = max(0, min(best_peer, total_blocks) - have)
        l3 = max(0, min(self._l3, total_blocks) - have - peer)
        return Placement(l1=l1, l2=l2, peer=peer, l3=l3)


def placement(reply: LookupReply | None, worker: str, total_blocks: int) -> Placement:
    """Where `worker` would get the request's leading blocks (one worker; `Placements` for many)."""
    return Placements(reply).of(worker, total_blocks)


def _own_tiers(match: WorkerMatch | None) -> tuple[int, int]:
    """Leading L1 blocks, then the rest of its own run (L2, or L1 after an L2 gap: the engine reloads both)."""
    if match is None:
        return 0, 0
    l1 = match.runs[0].blocks if match.runs and match.runs[0].tier is Tier.L1 else 0
    return l1, match.blocks - l1


def prefill_cost(prompt_tokens: int, block_size: int, where: Placement, s_per_token: float,
                 queued: float, fetch: FetchCosts) -> float:
    """Estimated seconds until this prefill is done on the worker (see the module docstring)."""
    recompute_block = block_size * s_per_token
    cached_blocks = min(where.l1 + where.l2 + where.peer + where.l3, prompt_tokens // block_size)
    uncached = prompt_tokens - cached_blocks * block_size
    fetched = 0.0
    left = cached_blocks
    # cheapest first: only matters when the counts exceed the prompt, and keeps the cost monotone then too
    for per_block, blocks in sorted(((0.0, where.l1), (fetch.l2_s, where.l2), (fetch.peer_s, where.peer),
                                     (fetch.l3_s, where.l3))):
        take = min(blocks, left)
        fetched += take * min(per_block, recompute_block)
        left -= take
    return uncached * s_per_token + max(queued, 0.0) * fetch.queue_s_per_request + fetched
