"""The longest prefix of a prompt this worker can reach, and the blocks to import for it.

Order: the engine's own pool (L1), then block by block this worker's L2 or
a same-host peer's shared-memory L2 (peers from heartbeats), then L3 chunk
by chunk from the first block still missing (unless the cache index, asked
meanwhile, knows L3 holds nothing further: a new prompt then costs no GETs). Only blocks a request can use
count: at least the last prompt token is always computed, so a prompt of n
tokens reaches at most (n - 1) // block_size blocks. Whatever is not
reached is simply computed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from shared.cache_index.client import lookup_prefix
from shared.cache_index.messages import LookupReply
from shared.engine.kv_block import KVBlock
from shared.serving.engine_loop import EngineLoop
from shared.serving.worker_tiers import WorkerTiers, namespace_for
from shared.tiers.l3_store import L3Store
from shared.tiers.miss import Miss, Tier

_INDEX_TIMEOUT_S = 0.02  # a lookup answers in about a millisecond; past this, L3 is asked instead
_PROBE_THREADS = 16  # concurrent GETs of one chunk's possible ends (a chunk is 16 blocks by default)


@dataclass(slots=True)
class Reach:
    hashes: list[bytes]  # chained hashes of the prompt's full blocks
    l1_blocks: int  # leading blocks already in the engine
    blocks: list[KVBlock] = field(default_factory=list)  # the run right after them, to import
    sources: Counter = field(default_factory=Counter)  # Tier -> blocks found there

    @property
    def reached_blocks(self) -> int:
        return self.l1_blocks + len(self.blocks)


async def reach_prefix(engine: EngineLoop, tiers: WorkerTiers, peer_ids: Sequence[str], prompt_ids: list[int],
                       tenant_salt: str, nc: NATS | None = None) -> Reach:
    """With `nc`, the cache index is asked (while L2 and peers are looked at) how far L3 holds the chain;
    a ready index that knows of nothing past the blocks found here saves the L3 GETs. No answer: ask L3."""
    salt = bytes.fromhex(tenant_salt)

    def look(e) -> tuple[list[bytes], int]:
        hashes = e.block_hashes(prompt_ids, salt)
        usable = hashes[: (len(prompt_ids) - 1) // e.block_size]
        return hashes, len(e.cache.lookup(usable, prompt_ids))

    hashes, l1 = await engine.call(look)
    usable = (len(prompt_ids) - 1) // engine.engine.block_size
    reach = Reach(hashes=list(hashes), l1_blocks=l1)
    reach.sources[Tier.L1] = l1
    index = None
    if nc is not None and tiers.l3 is not None and l1 < usable:
        index = asyncio.ensure_future(lookup_prefix(nc, hashes[:usable], _INDEX_TIMEOUT_S))
    i = l1
    while i < usable:
        block = await _from_host(tiers, peer_ids, hashes[i])
        if block is None:
            break
        tier, kb = block
        reach.blocks.append(kb)
        reach.sources[tier] += 1
        i += 1
    if index is not None and await _l3_known_to_end_by(index, i):
        return reach
    if i < usable and tiers.l3 is not None:
        # A chain that ends inside a chunk is found only by probing each possible end (a GET each);
        # worth it when nothing was reached here (restart, another host), not for the fresh tail of a
        # conversation whose earlier turns were local.
        found = await asyncio.to_thread(l3_run, tiers, tenant_salt, hashes[:usable], i, i == 0)
        reach.blocks += found
        reach.sources[Tier.L3] += len(found)
    return reach


async def _l3_known_to_end_by(index: asyncio.Future[LookupReply | None], reached: int) -> bool:
    """True when a ready index says L3 holds nothing past `reached` blocks (a hint: a chain uploaded
    a moment ago may not be indexed yet, which costs a recompute, never a wrong answer)."""
    reply = await index
    return reply is not None and reply.ready and reply.l3_blocks <= reached


async def _from_host(tiers: WorkerTiers, peer_ids: Sequence[str], block_hash: bytes) -> tuple[Tier, KVBlock] | None:
    got = tiers.l2.get(block_hash)
    if not isinstance(got, Miss):
        return Tier.L2, got.to_kv_block()
    for peer in peer_ids:
        got = await tiers.shm_peers.fetch(peer, block_hash)
        if not isinstance(got, Miss):
            return Tier.PEER, got.to_kv_block()
    return None


def l3_run(tiers: WorkerTiers, tenant_salt: str, hashes: Sequence[bytes], start: int,
           search_partial: bool = True) -> list[KVBlock]:
    """Blocks start.. of the chain from L3, chunk by chunk, until a chunk is missing.

    A chain stored shorter than this prompt ends in a partial chunk keyed by its own last block, so
    with `search_partial`, when a chunk's full key misses, shorter ends of that chunk are tried
    (all at once; the longest found wins) before giving up.
    """
    store = tiers.l3
    assert store is not None
    ns = namespace_for(tenant_salt)
    out: list[KVBlock] = []
    for positions in store.chunk_ranges(len(hashes)):
        if positions[-1] < start:
            continue
        lowest = max(start, positions[0]) if search_partial else positions[-1]
        found = _longest_end(store, ns, hashes, positions[-1], lowest)
        if found is None:
            return out
        end, chunk = found
        want = [hashes[p] for p in range(positions[0], end + 1)]
        if [b.header.block_hash for b in chunk] != want:
            return out
        out += [b.to_kv_block() for p, b in zip(range(positions[0], end + 1), chunk) if p >= start]
        if end != positions[-1]:
            return out
    return out


def _longest_end(store: L3Store, ns: str, hashes: Sequence[bytes], last: int,
                 lowest: int) -> tuple[int, list] | None:
    """The longest chunk ending in last..lowest that L3 holds: the full end first (the usual hit), then
    every shorter end at once (a miss on all of them, the common case for a new prompt, costs one GET's
    latency instead of one per position)."""
    chunk = store.get_chunk(store.key(ns, hashes[last]))
    if not isinstance(chunk, Miss):
        return last, chunk
    ends = list(range(last - 1, lowest - 1, -1))
    if not ends:
        return None
    with ThreadPoolExecutor(max_workers=min(len(ends), _PROBE_THREADS)) as pool:
        chunks = list(pool.map(lambda end: store.get_chunk(store.key(ns, hashes[end])), ends))
    for end, chunk in zip(ends, chunks):
        if not isinstance(chunk, Miss):
            return end, chunk
    return None
