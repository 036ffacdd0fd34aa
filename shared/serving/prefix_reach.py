"""The longest prefix of a prompt this worker can reach, brought into its engine.

Order: the engine's own pool (L1, never fetched), then, window by window
(shared/serving/kv_fetch.py), this worker's L2, the worker the router says
holds the prefix (`prefix_worker`, over the network peer client: it works
between hosts), same-host peers' shared-memory L2 (peers from heartbeats),
then L3 by chunk key, unless the cache index, asked meanwhile, knows L3
holds nothing further: a new prompt then costs no GETs. Only blocks a
request can use count: at least the last prompt token is always computed,
so a prompt of n tokens reaches at most (n - 1) // block_size blocks.
Reached blocks are imported as they arrive (under `lease`, the id the
request will run under, so they stay until it runs); whatever is not
reached is simply computed. With a `gate`, a tier that restores slower
than this worker computes is not asked (shared/serving/restore_gate.py).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.cache_index.client import lookup_prefix
from kvmesh.cache_index.messages import LookupReply
from kvmesh.config import WorkerSettings
from kvmesh.protocol.blocks import Tier
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.kv_fetch import (
    DEFAULT_WINDOW_BLOCKS,
    L2Source,
    L3Source,
    PeerSource,
    Source,
    cached_run,
    fetch_chain,
)
from kvmesh.serving.restore_gate import RestoreGate
from kvmesh.serving.worker_tiers import WorkerTiers, namespace_for
from nats.aio.client import Client as NATS

_INDEX_TIMEOUT_S = 0.02  # a lookup answers in about a millisecond; past this, L3 is asked instead
_INFLIGHT = WorkerSettings().resolve_inflight


@dataclass(slots=True)
class Reach:
    hashes: list[bytes]  # chained hashes of the prompt's full blocks
    l1_blocks: int  # leading blocks already in the engine
    imported: int = 0  # blocks right after them, fetched from the tiers and already in the engine
    sources: Counter = field(default_factory=Counter)  # Tier -> blocks found there
    restore_s: dict = field(default_factory=dict)  # Tier -> seconds until its last block was in the engine

    @property
    def reached_blocks(self) -> int:
        return self.l1_blocks + self.imported


async def reach_prefix(engine: EngineLoop, tiers: WorkerTiers, peer_ids: Sequence[str], prompt_ids: list[int],
                       tenant_salt: str, nc: NATS | None = None, prefix_worker: str | None = None,
                       lease: str | None = None, inflight: int = _INFLIGHT, gate: RestoreGate | None = None,
                       l3_blocks: int | None = None) -> Reach:
    """With `nc`, the cache index is asked (while the host tiers are looked at) how far L3 holds the chain;
    a ready index that knows of nothing past a window's start saves its L3 GETs. No answer: ask L3.
    `l3_blocks`: that answer, already asked at routing (the job carries it); the index is not asked again.

    The reached blocks are in the engine already (under `lease`, when given: release it with
    `EngineLoop.release_lease` if the request is never added).
    """
    salt = bytes.fromhex(tenant_salt)
    usable = (len(prompt_ids) - 1) // engine.engine.block_size
    hashes, l1 = await cached_run(engine, prompt_ids, salt, usable, lease)
    reach = Reach(hashes=list(hashes), l1_blocks=l1)
    reach.sources[Tier.L1] = l1
    if l1 >= usable:
        return reach
    sources: list[Source] = [L2Source(tiers.l2)]
    if prefix_worker and prefix_worker != tiers.worker_id and tiers.peer_client is not None:
        sources.append(PeerSource(tiers.peer_client, lambda p: (prefix_worker,)))
    shm_peers = tuple(peer_ids)
    if shm_peers:
        sources.append(PeerSource(tiers.shm_peers, lambda p: shm_peers))
    if tiers.l3 is not None:
        if l3_blocks is not None:
            known_end = _answered(l3_blocks)
        else:
            known_end = _ask_index(nc, tiers, tenant_salt, hashes) if nc is not None else None
        # A chain that ends inside a chunk is found only by probing each possible end (a GET each):
        # worth it when the prompt's start is not here (restart, another host), not for the fresh tail
        # of a conversation whose earlier turns were local.
        sources.append(L3Source(tiers.l3, namespace_for(tenant_salt), search_partial=l1 == 0, known_end=known_end))
    window = tiers.l3.chunk_blocks if tiers.l3 is not None else DEFAULT_WINDOW_BLOCKS
    if gate is not None:
        sources = [s for s in sources if gate.pays(s.tier)]
    fetched = await fetch_chain(engine, hashes, l1, usable, sources, tenant_salt=salt, lease=lease,
                                window_blocks=window, inflight=inflight)
    if gate is not None:
        gate.observe_restore(fetched.sources, fetched.fetch_s)
    reach.imported = len(fetched.hashes)
    reach.sources.update(fetched.sources)
    reach.restore_s = fetched.restore_s
    return reach


def _ask_index(nc: NATS, tiers: WorkerTiers, tenant_salt: str,
               hashes: list[bytes]) -> Callable[[], Awaitable[int | None]]:
    """Ask the cache index now; the result says how many leading blocks L3 holds (None: no ready answer).

    Its answer also reaches `tiers.note_l3_present` whenever it comes, asked for or not."""
    index = asyncio.ensure_future(lookup_prefix(nc, hashes, _INDEX_TIMEOUT_S))
    index.add_done_callback(lambda f: _note_l3(tiers, tenant_salt, hashes, f))

    async def known_end() -> int | None:
        reply = await asyncio.shield(index)
        return reply.l3_blocks if reply is not None and reply.ready else None

    return known_end


def _answered(l3_blocks: int) -> Callable[[], Awaitable[int | None]]:
    async def known_end() -> int | None:
        return l3_blocks

    return known_end


def _note_l3(tiers: WorkerTiers, tenant_salt: str, hashes: list[bytes], answer: asyncio.Future) -> None:
    """Tell the tiers how far the (ready) index says L3 holds this chain."""
    reply: LookupReply | None = None if answer.cancelled() or answer.exception() else answer.result()
    if reply is not None and reply.ready:
        tiers.note_l3_present(tenant_salt, hashes, reply.l3_blocks)
