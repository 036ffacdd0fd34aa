"""A worker's tiers below the engine: its L2, its L3 store and upload queue, its peer clients.

`register` is how finished blocks leave the engine: each block L2 lacks
goes into this worker's L2 (shared memory, so same-host peers map it) and
the chain is offered to the L3 upload queue (chunk keys are positional, so a
chain always goes from its first block). The queue skips, for free, every
chunk this worker knows is in L3 (its own writes, its reads, and what the
cache index reports through `note_l3_present`), so a session's next turn
uploads only its new chunks; the rest it reads from L2 when their turn
comes. The handles it returns name this worker's L2 copy; a decode
worker resolves them through its `Resolver` (own L2, the owner's shared
memory, the owner over NATS, L3).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from kvmesh.config import Settings
from kvmesh.engine.kv_block import KVBlock
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.log import get_logger
from kvmesh.protocol.blocks import BlockHandle, Tier
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.factory import build_host_tier, build_l3_store
from kvmesh.tiers.known_chunks import KnownChunks
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.l3_touch import L3Touches
from kvmesh.tiers.miss import MissCounters
from kvmesh.tiers.namespace import namespace_for
from kvmesh.tiers.resolver import Resolver
from kvmesh.tiers.upload_queue import UploadQueue
from kvmesh.transfer.peer_nats import NatsPeerClient, NatsPeerServer
from kvmesh.transfer.peer_shm import ShmPeerClient
from nats.aio.client import Client as NATS

log = get_logger(__name__)


class L2Source:
    """This worker's L2 as the upload queue reads it: an upload is not an access (no policy touch)."""

    def __init__(self, l2: HostTier) -> None:
        self.l2 = l2

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.l2

    def read(self, block_hash: bytes) -> memoryview | None:
        return self.l2.arena.read(block_hash) if block_hash in self.l2 else None


@dataclass
class WorkerTiers:
    worker_id: str
    l2: HostTier
    l3: L3Store | None
    uploads: UploadQueue | None
    shm_peers: ShmPeerClient  # same host only: probing many peers must cost no network round trip
    resolver: Resolver  # own L2 -> the owner (shared memory, then NATS) -> L3
    counters: MissCounters
    events: KVEventPublisher | None = None  # L2 / L3 changes for the cache index
    _peer_server: NatsPeerServer | None = None
    _peer_client: NatsPeerClient | None = None
    _touch_task: asyncio.Task[None] | None = None  # flushes L3 read touches every interval
    storing: int = 0  # chains being stored now (`storing_chain`): the upload queue waits for them

    @property
    def peer_client(self) -> NatsPeerClient | None:
        """The network peer client (NATS): reaches a worker on any host, e.g. a job's `prefix_worker`."""
        return self._peer_client

    @classmethod
    async def start(cls, settings: Settings, nc: NATS, worker_id: str, fingerprint: str, block_size: int,
                    events: KVEventPublisher | None = None, block_bytes: int | None = None) -> WorkerTiers:
        """`block_bytes`: the KV payload of one block (sizes a shared-memory L2's directory; None: a guess)."""
        counters = MissCounters()
        l2 = build_host_tier(settings, fingerprint, worker_id, counters, block_bytes)
        l3 = build_l3_store(settings, fingerprint, block_size, counters)
        uploads = None
        if l3 is not None:
            on_uploaded = None
            if events is not None:
                def on_uploaded(hashes: list[bytes]) -> None:
                    events.stored(hashes, Tier.L3, tokens_per_block=block_size)

                l3.on_quarantined = lambda hashes: events.removed(hashes, Tier.L3)
            t = settings.tiers
            l3.known = KnownChunks(t.l3_known_chunks, t.l3_known_max_age_s)
            l3.touches = L3Touches()  # reads refresh last-access: the GC's TTL counts from the last read
            uploads = UploadQueue(l3, t.l3_upload_queue_bytes, source=L2Source(l2), tail_delay_s=t.l3_tail_delay_s,
                                  on_uploaded=on_uploaded)
            uploads.start()
        server = NatsPeerServer(nc, l2, worker_id)
        await server.start()
        client = NatsPeerClient(nc, fingerprint, counters, timeout_s=settings.tiers.peer_timeout_s)
        await client.start()
        shm = ShmPeerClient(fingerprint, counters)
        resolver = Resolver(worker_id, l1=None, l2=l2, peers=ShmPeerClient(fingerprint, counters, client, shm.slabs),
                            l3=l3, counters=counters)
        tiers = cls(worker_id, l2, l3, uploads, shm, resolver, counters, events, server, client)
        if l3 is not None and l3.touches is not None:
            tiers._touch_task = asyncio.create_task(l3.touches.run(l3.client, l3.bucket))
        return tiers

    async def close(self) -> None:
        if self.uploads is not None:
            await self.uploads.close()
        if self._touch_task is not None and self.l3 is not None and self.l3.touches is not None:
            self._touch_task.cancel()
            await asyncio.gather(self._touch_task, return_exceptions=True)
            await asyncio.to_thread(self.l3.touches.flush, self.l3.client, self.l3.bucket)
        if self._peer_server is not None:
            await self._peer_server.stop()
        if self._peer_client is not None:
            await self._peer_client.close()
        self.shm_peers.slabs.close()
        self.l2.close()

    @contextmanager
    def storing_chain(self) -> Iterator[None]:
        """Mark a chain being stored (the L3 uploads hold back until none is)."""
        self.storing += 1
        try:
            yield
        finally:
            self.storing -= 1

    def missing(self, hashes: list[bytes]) -> list[bytes]:
        """The hashes not in this worker's L2: only these need to leave the engine."""
        return [h for h in hashes if h not in self.l2]

    def register(self, hashes: list[bytes], exported: list[KVBlock], tenant_salt: str,
                 session_id: str | None = None, keep_chain: bool = False) -> tuple[list[BlockHandle], list]:
        """Put the chain `hashes` (position 0 first) into L2 and offer it to the L3 upload queue.

        `session_id` (the job's) is named in the KV events of the blocks L2 newly stores.

        `exported` holds the blocks L2 lacked (from the engine); each is encoded straight into L2.
        Returns the handles of the leading run that L2 holds, and the chain as the upload queue
        gets it: the encoded bytes of a block L2 could not take (pinned full: the queue keeps them),
        None for one L2 holds (the queue reads it from L2 at its turn). `keep_chain` fills in every
        block's bytes (a direct L3 write: named caches). A block neither in L2 nor exported ends the
        chain; one L2 cannot take ends the handles only. A chain whose chunks are all known in L3
        costs no encode for L3 and no S3 request.
        """
        by_hash = {kb.block_hash: kb for kb in exported}
        handles: list[BlockHandle] = []
        chain: list = []
        for h in hashes:
            handle = self.l2.handle(h)
            encoded = None
            if handle is not None and keep_chain:
                got = self.l2.get_encoded(h)
                encoded, handle = (got, handle) if isinstance(got, memoryview) else (None, None)
            if handle is None:
                kb = by_hash.get(h)
                if kb is None:
                    break
                put = self.l2.put_block(kb)
                handle = put.handle if put.stored else None
                self._announce(h, kb, put.stored, put.evicted, session_id)
                if handle is None or keep_chain:
                    encoded = encode_kv_block(kb, self.l2.fingerprint)
            chain.append(encoded)
            if handle is not None and len(handles) == len(chain) - 1:
                handles.append(handle)
        if chain and self.uploads is not None:
            self.uploads.submit(namespace_for(tenant_salt), hashes[:len(chain)], chain)
        return handles, chain

    def note_l3_present(self, tenant_salt: str, hashes: Sequence[bytes], num_blocks: int) -> None:
        """The cache index says the first `num_blocks` blocks of this chain are in L3: the full chunks
        among them need no upload (a hint that ages out; see shared/tiers/known_chunks.py). A partial
        chunk is not marked: its blocks may sit in a longer chain's chunk, under another key."""
        if self.l3 is None:
            return
        ns = namespace_for(tenant_salt)
        for positions in self.l3.chunk_ranges(min(num_blocks, len(hashes))):
            if len(positions) == self.l3.chunk_blocks:
                self.l3.note_known(ns, hashes[positions[-1]])

    def _announce(self, block_hash: bytes, kb: KVBlock, stored: bool, evicted: list[bytes],
                  session_id: str | None = None) -> None:
        if self.events is None:
            return
        if evicted:
            self.events.removed(evicted, Tier.L2)
        if stored:
            self.events.stored([block_hash], Tier.L2, parent=kb.parent_hash, tokens_per_block=len(kb.token_ids),
                               session_id=session_id)

    def pin(self, hashes: list[bytes], until_monotonic: float) -> None:
        for h in hashes:
            self.l2.pin(h, until_monotonic)

    async def write_l3_now(self, chain: list, tenant_salt: str, ttl_s: float) -> bool:
        """Write a chain to L3 with its own TTL in the object metadata and wait for it (named caches)."""
        if self.l3 is None:
            return False
        store = replace(self.l3, ttl_s=int(ttl_s))
        try:
            await asyncio.to_thread(store.put_chain, namespace_for(tenant_salt), chain)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as "not durable"
            log.warning("L3 write failed", error=repr(exc))
            return False
        return True
