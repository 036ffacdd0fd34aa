"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends at most `max_num_batched_tokens` new tokens: first one
token for every running decode (decodes are never starved by a long
prefill), then chunks of running prefills, then newly admitted requests
(FCFS, prefix-cache hits skip their cached tokens). When the pool has no
block for a running request, the newest running request is preempted: its
blocks are released (full ones stay cached, so its recompute mostly hits)
and it goes back to the front of the queue. Blocks under a lease
(shared/engine/leases.py) or a pin (shared/engine/pins.py) are not
allocatable, but both are advice, never a wait: when nothing runs and the
next request cannot be admitted otherwise (nothing else would ever free a
block), idle pinned blocks are unpinned first (they are kept for a later
use, a lease for a request already queued), then leases are broken; a
running request that would otherwise preempt itself takes idle pinned
blocks too. So the head of the queue is always admitted once nothing
runs: `add_request` refused any request that needs more than the pool.
A request's own lease ends with it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvmesh.config import EngineSettings
from kvmesh.engine.block_pool import Block
from kvmesh.engine.leases import LeaseSet
from kvmesh.engine.pins import PinSet
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.protocol.block_hash import BlockHash


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    num_new: int  # tokens computed for it this step
    sample: bool  # the chunk reaches the last known token: sample the next one


class Scheduler:
    def __init__(self, settings: EngineSettings, cache: PrefixCache, leases: LeaseSet | None = None,
                 pins: PinSet | None = None) -> None:
        self.settings = settings
        self.cache = cache
        self.leases = leases if leases is not None else LeaseSet(cache)
        self.pins = pins
        self.num_broken_leases = 0
        self.block_size = cache.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out (finished or aborted) and release its blocks and its lease."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.cache.release(request.blocks)
        request.blocks = []
        self.leases.release(request.request_id)
        request.status = RequestStatus.FINISHED

    # --- one step ------------------------------------------------------

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.settings.max_num_batched_tokens
        planned: dict[Request, int] = {}
        decodes = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, n, planned):
                continue  # req itself was preempted
            planned[req] = n
            budget -= n
        budget = self.settings.max_num_batched_tokens - sum(planned.values())
        while self.waiting and budget > 0 and len(self.running) < self.settings.max_num_seqs:
            n = self._admit(self.waiting[0], budget)
            if n == 0 and not self.running:
                n = self._admit_reclaiming(self.waiting[0], budget)
            if n == 0:
                break
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            planned[req] = n
            budget -= n
        return [
            ScheduledSeq(r, n, r.num_computed + n == r.num_tokens)
            for r, n in planned.items()
        ]

    def commit(self, scheduled: list[ScheduledSeq]) -> None:
        """After the forward pass: count the computed tokens and cache blocks that became full."""
        bs = self.block_size
        for s in scheduled:
            req = s.request
            req.num_computed += s.num_new
            for i in range(req.num_cached_blocks, req.num_computed // bs):
                parent = req.block_hashes[i - 1] if i > 0 else None
                self.cache.store(req.blocks[i], req.block_hashes[i], parent, req.block_tokens(i), depth=i)
            req.num_cached_blocks = max(req.num_cached_blocks, req.num_computed // bs)

    # --- internals -----------------------------------------------------

    def _blocks_needed(self, req: Request, n: int) -> int:
        return -(-(req.num_computed + n) // self.block_size) - len(req.blocks)

    def _grow(self, req: Request, n: int, planned: dict[Request, int]) -> bool:
        """Give req blocks for n more tokens, preempting the newest requests if needed."""
        need = self._blocks_needed(req, n)
        while need > self.cache.num_allocatable:
            if len(self.running) == 1 and self._yield_pins(need - self.cache.num_allocatable):
                continue  # req runs alone: preempting it would leave the pool to pins
            victim = self.running[-1]
            self._preempt(victim)
            planned.pop(victim, None)
            if victim is req:
                return False
        if need > 0:
            blocks = self.cache.allocate(need)
            assert blocks is not None
            req.blocks.extend(blocks)
        return True

    def _plan(self, req: Request, budget: int) -> tuple[list[BlockHash], list[Block], int, int, int]:
        """(hashes looked up, cached hit, tokens of the first chunk, fresh blocks it needs,
        how many of those the pool cannot give now)."""
        bs = self.block_size
        # At least one token must be computed to get logits: never hit the whole sequence.
        max_hit_blocks = (req.num_tokens - 1) // bs if self.settings.enable_prefix_caching and req.use_cache else 0
        hashes = req.block_hashes[:max_hit_blocks]
        hit = self.cache.lookup(hashes, req.token_ids)
        hit_tokens = len(hit) * bs
        n = min(req.num_tokens - hit_tokens, budget)
        need = -(-(hit_tokens + n) // bs) - len(hit)
        reclaimed = sum(1 for b in hit if b.ref_count == 0)  # evictable now, in use once taken
        return hashes, hit, n, need, max(0, need - (self.cache.num_allocatable - reclaimed))

    def _admit(self, req: Request, budget: int) -> int:
        """Attach the cached prefix and blocks for the first chunk; 0 if it does not fit now."""
        hashes, _, n, need, short = self._plan(req, budget)
        if short:
            return 0
        hit = self.cache.acquire_prefix(hashes, req.token_ids)  # the same run `_plan` found
        hit_tokens = len(hit) * self.block_size
        fresh = self.cache.allocate(need) if need > 0 else []
        assert fresh is not None
        req.blocks = hit + fresh
        req.num_computed = hit_tokens
        req.num_cached_blocks = len(hit)
        if req.cached_tokens is None:
            req.cached_tokens = min(hit_tokens, req.num_prompt_tokens)
        return n

    def _admit_reclaiming(self, req: Request, budget: int) -> int:
        """Nothing runs, so nothing will free a block: unpin idle blocks, then end leases (newest first,
        req's own last) until req fits. Either costs at most a recompute later, never a wrong answer."""
        order = [lease for lease in self.leases.newest_first() if lease != req.request_id]
        order += [req.request_id] if req.request_id in self.leases else []
        while True:
            _, hit, _, _, short = self._plan(req, budget)
            if not short:
                return self._admit(req, budget)
            if self._yield_pins(short, frozenset(b.block_id for b in hit)) >= short:
                continue
            if not order:
                break
            self.leases.release(order.pop(0))
            self.num_broken_leases += 1
        raise RuntimeError(f"request {req.request_id!r} cannot be admitted although nothing runs and no lease or pin "
                           f"holds the pool ({self.cache.num_allocatable} of {self.cache.pool.num_blocks} allocatable)")

    def _yield_pins(self, n: int, keep: frozenset[int] = frozenset()) -> int:
        return self.pins.yield_idle(n, keep) if self.pins is not None else 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_cached_blocks = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
