"""The connector's tiers: L2 in the vLLM worker's shared-memory slab, L3 in S3; a read-only view for the scheduler.

vLLM runs the connector twice, in two processes that share no memory: the
scheduler's copy decides how many tokens to load, the worker's copy moves the
bytes. So the worker owns the data (`WorkerStore`: its L2 is a kvmesh slab,
`/dev/shm/kvmesh_<worker>_l2`, and its L3 uploads), and the scheduler reads
where it stands (`StoreView`: the slab's directory, mapped read-only, then S3
chunk by chunk). Other vLLM workers on the host (`peers`, by worker id, and
those a request names: request_peers.py) are read the same way: their slabs
after this worker's own, before S3. Both are built from kvmesh's own
settings (`KVMESH_*` environment, the state dir's S3 credentials), as any
kvmesh worker's are.

What the view reports is a promise the worker may fail to keep (L2 evicts
freely, an object can vanish): a block the worker cannot fetch and verify is a
load error, and vLLM recomputes it. Nothing unverified is ever written into
vLLM's KV.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from kvmesh.bus.consumer import Handler
from kvmesh.config import Settings
from kvmesh.connectors.vllm.fleet import FleetLink
from kvmesh.engine.kv_block import KVBlock
from kvmesh.log import get_logger
from kvmesh.serving.worker_tiers import L2Source
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.block_format import StoredBlock, decode_or_miss, encode_kv_block
from kvmesh.tiers.factory import build_host_tier, build_l3_store
from kvmesh.tiers.known_chunks import KnownChunks
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import Miss, MissCounters
from kvmesh.tiers.namespace import namespace_for
from kvmesh.tiers.shm_slab import SlabReader
from kvmesh.tiers.upload_queue import UploadQueue
from minio.error import S3Error

log = get_logger(__name__)
BUSY_S = 0.25  # vLLM's steps follow each other within milliseconds while it serves; idle, none come


class _LockedL2(L2Source):
    """The worker's L2 as the upload queue reads it, under the store's L2 lock."""

    def __init__(self, l2: HostTier, lock: threading.Lock) -> None:
        super().__init__(l2)
        self.lock = lock

    def __contains__(self, block_hash: bytes) -> bool:
        with self.lock:
            return super().__contains__(block_hash)

    def read(self, block_hash: bytes) -> memoryview | None:
        with self.lock:
            return super().read(block_hash)


@dataclass(slots=True)
class Reach:
    """How far a chain is held: `l2` blocks in host memory (the worker's L2 or a peer's) from position 0,
    `total` in host memory then L3."""

    l2: int
    total: int


class StoreView:
    """The scheduler's read-only view of a worker's tiers, and of its same-host peers' L2 slabs."""

    def __init__(self, settings: Settings, worker_id: str, fingerprint: str, block_size: int,
                 peers: Sequence[str] = ()) -> None:
        self.worker_id = worker_id
        self.peers = [p for p in peers if p != worker_id]
        self.slab = SlabReader()
        self.l3 = build_l3_store(settings, fingerprint, block_size, MissCounters())
        if self.l3 is not None:
            self.l3.known = KnownChunks(settings.tiers.l3_known_chunks, settings.tiers.l3_known_max_age_s)

    def reach(self, salt_hex: str, hashes: Sequence[bytes], peers: Sequence[str] = ()) -> Reach:
        """The longest prefix of `hashes` the worker can load: host memory first (its L2, then its peers' and
        those of `peers`), then whole L3 chunks."""
        owners = list(dict.fromkeys((self.worker_id, *self.peers, *peers)))
        in_l2 = 0
        while in_l2 < len(hashes) and any(self.slab.holds(w, hashes[in_l2]) for w in owners):
            in_l2 += 1
        total = in_l2
        if self.l3 is not None:
            ns = namespace_for(salt_hex)
            for positions in self.l3.chunk_ranges(len(hashes)):
                if positions[-1] < total:
                    continue
                if not self._in_l3(ns, hashes[positions[-1]]):
                    break
                total = positions[-1] + 1
        return Reach(in_l2, total)

    def _in_l3(self, ns: str, last_hash: bytes) -> bool:
        assert self.l3 is not None
        if self.l3.is_known(ns, last_hash):
            return True
        if not self.l3.breaker.allow():
            return False
        try:
            self.l3.client.stat_object(self.l3.bucket, self.l3.key(ns, last_hash))
        except S3Error:
            self.l3.breaker.record_success()  # S3 answered: not there
            return False
        except Exception:  # noqa: BLE001 - S3 down or slow: the scheduler does not wait for it
            self.l3.breaker.record_failure()
            return False
        self.l3.breaker.record_success()
        self.l3.note_known(ns, last_hash)
        return True

    def close(self) -> None:
        self.slab.close()


class WorkerStore:
    """The worker's tiers: fetch verified blocks for a load, keep computed blocks (L2 now, L3 in the background)."""

    def __init__(self, settings: Settings, worker_id: str, fingerprint: str, block_size: int,
                 block_bytes: int, peers: Sequence[str] = (), fleet_role: str = "vllm") -> None:
        self.block_size = block_size
        self.block_bytes = block_bytes  # one block's KV, all layers (sizes L2's directory and pin budget)
        self.peers = [p for p in peers if p != worker_id]
        self.peer_slabs = SlabReader()
        self.counters = MissCounters()
        self.l2: HostTier = build_host_tier(settings, fingerprint, worker_id, self.counters, block_bytes)
        self.l3: L3Store | None = build_l3_store(settings, fingerprint, block_size, self.counters)
        self.uploads: UploadQueue | None = None
        self.fleet: FleetLink | None = None
        self.last_step = 0.0  # monotonic time vLLM's worker last ran a step (stepped())
        # L2 has two users: vLLM's worker thread (loads, keeps) and the connector's loop (uploads, advice)
        self.l2_lock = threading.Lock()
        self._slabs_lock = threading.Lock()  # the peers' mappings: loads and prefetches read them
        self._loop = asyncio.new_event_loop()  # uploads and the fleet link run here, on a thread of their own
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvmesh-connector", daemon=True)
        self._thread.start()
        if settings.nats_url:
            self.fleet = self._run(FleetLink.join(settings, worker_id, load=lambda: 0.0, role=fleet_role), 30)
        if self.l3 is not None:
            t = settings.tiers
            self.l3.known = KnownChunks(t.l3_known_chunks, t.l3_known_max_age_s)
            self.l3.ensure_bucket()
            on_uploaded = None if self.fleet is None else partial(self.fleet.l3_stored, tokens_per_block=block_size)
            self.uploads = UploadQueue(self.l3, t.l3_upload_queue_bytes, source=_LockedL2(self.l2, self.l2_lock),
                                       tail_delay_s=t.l3_tail_delay_s, on_uploaded=on_uploaded, busy=self.busy,
                                       max_defer_s=t.connector_upload_max_defer_s)
            self._run(self._start_uploads(), 10)

    def fetch(self, salt_hex: str, hashes: Sequence[bytes], first: int,
              peers: Sequence[str] = ()) -> tuple[list[StoredBlock], Counter]:
        """Verified blocks for positions `first`.. of the chain `hashes`, as far as they are found in order,
        and how many came from each tier. `peers`: more same-host workers to read, after the configured ones."""
        found: list[StoredBlock] = []
        tiers: Counter = Counter()
        owners = [p for p in dict.fromkeys((*self.peers, *peers)) if p != self.l2.worker_id]
        pos = first
        while pos < len(hashes):
            with self.l2_lock:
                got = self.l2.get(hashes[pos])
            tier = Tier.L2
            if isinstance(got, Miss):
                got, tier = self._from_peers(hashes[pos], owners), Tier.PEER
            if got is None:
                break
            found.append(got)
            tiers[tier] += 1
            pos += 1
        if self.l3 is None:
            return found, tiers
        ns = namespace_for(salt_hex)
        for positions in self.l3.chunk_ranges(len(hashes)):
            if positions[-1] < pos:
                continue
            if positions[0] > pos:
                break
            chunk = self.l3.get_chunk(self.l3.key(ns, hashes[positions[-1]]))
            if isinstance(chunk, Miss) or [b.header.block_hash for b in chunk] != [hashes[i] for i in positions]:
                break
            found += chunk[pos - positions[0]:]
            tiers[Tier.L3] += positions[-1] + 1 - pos
            pos = positions[-1] + 1
        return found, tiers

    def _from_peers(self, block_hash: bytes, owners: Sequence[str]) -> StoredBlock | None:
        """A verified copy out of a same-host peer's slab (a damaged or overwritten copy is a counted miss)."""
        for peer in owners:
            with self._slabs_lock:
                buf = self.peer_slabs.read(peer, block_hash)
            got = None if buf is None else decode_or_miss(buf, self.l2.fingerprint, block_hash, Tier.PEER,
                                                          self.counters)
            if isinstance(got, StoredBlock):
                return got
        return None

    def keep(self, salt_hex: str, hashes: Sequence[bytes], blocks: dict[bytes, KVBlock]) -> int:
        """Put `blocks` (by hash) into L2 and offer the chain `hashes` (position 0 first) to L3; how many L2 took.

        A block of the chain L2 already holds is read from L2 when its chunk's upload comes; one L2
        could not take goes to the queue encoded. A block neither held nor given (L2 let it go since)
        ends what L3 is offered, since chunks are positional; the given blocks after it still go to L2.
        """
        stored: list[tuple[bytes, bytes | None]] = []
        evicted: list[bytes] = []
        chain: list = []
        gap = False
        with self.l2_lock:
            for h in hashes:
                kb = blocks.get(h)
                if h in self.l2:
                    entry = None
                elif kb is not None:
                    put = self.l2.put_block(kb)
                    evicted += put.evicted
                    if put.stored:
                        stored.append((h, kb.parent_hash))
                    entry = None if put.stored else encode_kv_block(kb, self.l2.fingerprint)
                else:
                    gap = True
                    continue
                if not gap:
                    chain.append(entry)
        self._announce(stored, evicted)
        if chain and self.uploads is not None:
            self._loop.call_soon_threadsafe(self.uploads.submit, namespace_for(salt_hex), list(hashes[:len(chain)]),
                                            chain)
        return len(stored)

    def stepped(self) -> None:
        """vLLM's worker ran a step: uploads wait while steps keep coming (busy)."""
        self.last_step = time.monotonic()

    def busy(self) -> bool:
        """vLLM computed within BUSY_S: an L3 upload waits for a gap (up to tiers.connector_upload_max_defer_s)
        rather than contend with a forward pass for the cores and for this process's GIL."""
        return time.monotonic() - self.last_step < BUSY_S

    def held(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, L2 holds."""
        with self.l2_lock:
            return next((i for i, h in enumerate(hashes) if h not in self.l2), len(hashes))

    def put(self, blocks: Sequence[StoredBlock]) -> int:
        """Verified blocks into L2 (those it holds already are skipped); how many it took."""
        stored: list[tuple[bytes, bytes | None]] = []
        evicted: list[bytes] = []
        with self.l2_lock:
            for block in blocks:
                kb = block.to_kv_block()
                if kb.block_hash in self.l2:
                    continue
                put = self.l2.put_block(kb)
                evicted += put.evicted
                if put.stored:
                    stored.append((kb.block_hash, kb.parent_hash))
        self._announce(stored, evicted)
        return len(stored)

    def pin(self, hashes: Sequence[bytes], until: float) -> int:
        """Pin the leading `hashes` L2 holds until `until` (L2's monotonic clock); how many."""
        with self.l2_lock:
            n = next((i for i, h in enumerate(hashes) if h not in self.l2), len(hashes))
            for h in hashes[:n]:
                self.l2.pin(h, until)
        return n

    def drop(self, hashes: Sequence[bytes]) -> int:
        """Forget the L2 copies of `hashes` that are not pinned; how many went."""
        with self.l2_lock:
            now = self.l2.clock()
            gone = [h for h in hashes if not self.l2.is_pinned(h, now) and self.l2.remove(h)]
        self._announce([], gone)
        return len(gone)

    def _announce(self, stored: list[tuple[bytes, bytes | None]], evicted: list[bytes]) -> None:
        """L2's changes, as KV events (from any thread: they go out on the connector's loop)."""
        if self.fleet is not None and (stored or evicted):
            self._loop.call_soon_threadsafe(self.fleet.l2_changed, stored, evicted, self.block_size)

    def take_commands(self, handler: Handler) -> None:
        """Apply this worker's eviction commands with `handler` (advice.py), on the connector's loop."""
        if self.fleet is not None:
            self._run(self._obey(handler), 10)

    async def _obey(self, handler: Handler) -> None:
        assert self.fleet is not None
        self.fleet.obey(handler)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every chunk offered to L3 has landed (tests, shutdown)."""
        if self.uploads is None:
            return True
        return self._run(self.uploads.join(timeout_s), timeout_s + 5)

    def close(self, drain_s: float = 30.0) -> None:
        """Let queued uploads land (up to `drain_s`), then stop; L2 goes with the process."""
        if self.uploads is not None:
            if not self.drain(drain_s):
                log.warning("l3 uploads abandoned at shutdown", chunks=self.uploads.pending_chunks)
            self._run(self.uploads.close(), 30)
        if self.fleet is not None:
            self._run(self.fleet.leave(), 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.peer_slabs.close()
        self.l2.close()

    async def _start_uploads(self) -> None:
        assert self.uploads is not None
        self.uploads.start()

    def _run(self, coro, timeout_s: float):
        """Run `coro` on the connector's loop and wait for its result (from the worker thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)
