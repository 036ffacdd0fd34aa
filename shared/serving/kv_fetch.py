"""Bring the missing run of a KV chain into the engine: windows fetched concurrently, imported in order.

Both workers restore a chain the same way; only their sources differ (prefill:
own L2, the worker the router named, same-host peers, L3; decode: own L2, each
handle's owner, L3). The run `[start, stop)` after the blocks already in the
engine (L1, never fetched) is cut into windows at L3 chunk boundaries, so a
window is one chunk GET, one peer batch, one import. Up to `inflight` windows
travel at once; each is imported into the pool (`Engine.import_chain`, under the
request's lease) as soon as it and every window before it are in, so window k+1
is on the wire while window k is copied into the pool. Within a window the
sources are asked cheapest first, each for the run the ones before it lacked;
a source that adds blocks sends the next ask back to the cheapest. The chain
ends at the first block no source has or the engine does not take: later
windows are dropped and the rest is recomputed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.engine.kv_block import KVBlock
from kvmesh.log import get_logger
from kvmesh.protocol.blocks import Tier
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.tiers.block_format import StoredBlock
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import Miss
from kvmesh.tiers.resolver import PeerClient

log = get_logger(__name__)

DEFAULT_WINDOW_BLOCKS = 16  # without L3: a peer batch as big as an L3 chunk of 256 tokens at block size 16
_PROBE_THREADS = 16  # concurrent GETs of one chunk's possible ends


@dataclass(slots=True)
class Window:
    """Positions `start..stop-1` of the chain, inside the L3 chunk `chunk_start..chunk_stop-1`."""

    chunk_start: int
    chunk_stop: int
    start: int
    stop: int
    prev_full: asyncio.Future[bool]  # the window before came back whole (the chain reaches this one)


class Source(Protocol):
    tier: Tier

    async def fetch(self, hashes: Sequence[bytes], start: int, window: Window) -> list[KVBlock]:
        """The blocks at positions start, start+1, ... (< window.stop) this source has, up to its first miss."""
        ...


@dataclass
class Fetched:
    # Hashes imported, in chain order, from position `start`. Only hashes: a block's bytes (a view of
    # the whole L3 object or peer message it came in) are let go once it is in the pool, so a long
    # restore holds no more than its windows in flight.
    hashes: list[bytes] = field(default_factory=list)
    sources: Counter = field(default_factory=Counter)  # Tier -> blocks imported from there
    restore_s: dict = field(default_factory=dict)  # Tier -> seconds from the start until its last block was in
    fetch_s: Counter = field(default_factory=Counter)  # Tier -> seconds its sources took to return blocks (no import)


async def cached_run(engine: EngineLoop, prompt_ids: Sequence[int], salt: bytes, limit: int | None,
                     lease: str | None) -> tuple[list[bytes], int]:
    """The prompt's full-block hashes, and how many of the first `limit` are in the engine (L1),
    put under `lease` at once so they stay while the rest is fetched."""

    def look(e) -> tuple[list[bytes], int]:
        hashes = e.block_hashes(prompt_ids, salt)
        cap = hashes if limit is None else hashes[:limit]
        l1 = len(e.cache.lookup(cap, prompt_ids))
        if lease is not None and l1:
            e.lease_cached(lease, cap[:l1])
        return hashes, l1

    return await engine.call(look)


async def fetch_chain(engine: EngineLoop, hashes: Sequence[bytes], start: int, stop: int, sources: Sequence[Source],
                      *, tenant_salt: bytes, lease: str | None, window_blocks: int, inflight: int) -> Fetched:
    """Import positions start..stop-1 of the chain `hashes` (position 0 first; it may go on past `stop`:
    L3 keys chunks by their last block) from `sources`.

    The imported blocks are held under `lease` (see `EngineLoop.release_lease`); without one they
    are held only while the fetch runs, so a chain never makes room for its end by evicting its start.
    """
    windows = _windows(start, stop, window_blocks)
    out = Fetched()
    if not windows:
        return out
    own_lease = lease is None
    if own_lease:
        lease = f"kv-fetch:{uuid.uuid4().hex}"
    windows[0].prev_full.set_result(True)
    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()

    def launch(k: int) -> None:
        if k < len(windows):
            nxt = windows[k + 1].prev_full if k + 1 < len(windows) else None
            tasks.append(asyncio.ensure_future(_fill(hashes, windows[k], sources, nxt, out.fetch_s)))

    try:
        for k in range(min(inflight, len(windows))):
            launch(k)
        for k, w in enumerate(windows):
            try:
                parts = await tasks[k]
            except Exception as exc:  # noqa: BLE001 - a source that fails is a miss: the rest is recomputed
                log.warning("KV fetch failed; recomputing from here", position=w.start, error=repr(exc))
                break
            launch(k + inflight)  # in flight while this window is imported
            blocks = [kb for _, run in parts for kb in run]
            if not blocks:
                break
            res = await engine.call(lambda e, b=blocks: e.import_chain(b, tenant_salt, lease=lease))
            landed = res.reached
            out.hashes += [kb.block_hash for kb in blocks[:landed]]
            now = time.perf_counter()
            for tier, run in parts:
                if min(len(run), landed):
                    out.restore_s[tier] = now - t0
                out.sources[tier] += min(len(run), landed)
                landed -= min(len(run), landed)
            if res.reached < w.stop - w.start:
                break
    finally:
        for w in windows:  # a window still waiting for its predecessor gives up
            if not w.prev_full.done():
                w.prev_full.set_result(False)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if own_lease:
            engine.release_lease(lease)
    return out


def _windows(start: int, stop: int, size: int) -> list[Window]:
    loop = asyncio.get_running_loop()
    first = start - start % size
    return [Window(a, a + size, max(start, a), min(stop, a + size), loop.create_future())
            for a in range(first, stop, size)]


async def _fill(hashes: Sequence[bytes], w: Window, sources: Sequence[Source],
                nxt: asyncio.Future[bool] | None, fetch_s: Counter) -> list[tuple[Tier, list[KVBlock]]]:
    """(tier, run) pieces covering w from its start up to the first block no source has; the seconds each
    tier took to return its run are added to `fetch_s` (what a restore costs before the import)."""
    parts: list[tuple[Tier, list[KVBlock]]] = []
    pos = w.start
    try:
        while pos < w.stop:
            for source in sources:
                t0 = time.perf_counter()
                run = (await source.fetch(hashes, pos, w))[: w.stop - pos]
                if run:
                    fetch_s[source.tier] += time.perf_counter() - t0
                    parts.append((source.tier, run))
                    pos += len(run)
                    break
            else:
                break
    finally:
        if nxt is not None and not nxt.done():
            nxt.set_result(pos == w.stop)
    return parts


def _leading(got: Sequence[StoredBlock | Miss]) -> list[KVBlock]:
    run = []
    for g in got:
        if isinstance(g, Miss):
            break
        run.append(g.to_kv_block())
    return run


# --- sources -----------------------------------------------------------------


@dataclass
class L2Source:
    """This worker's host memory."""

    l2: HostTier
    tier: Tier = Tier.L2

    async def fetch(self, hashes: Sequence[bytes], start: int, window: Window) -> list[KVBlock]:
        run = []
        for p in range(start, window.stop):
            got = self.l2.get(hashes[p])
            if isinstance(got, Miss):
                break
            run.append(got.to_kv_block())
        return run


@dataclass
class PeerSource:
    """Other workers' L1/L2 in batches (`fetch_many`): `owners(p)` names who may hold position p,
    in the order to ask; positions naming the same owners travel in one batch."""

    client: PeerClient
    owners: Callable[[int], tuple[str, ...]]
    tier: Tier = Tier.PEER

    async def fetch(self, hashes: Sequence[bytes], start: int, window: Window) -> list[KVBlock]:
        who = self.owners(start)
        end = start + 1
        while end < window.stop and self.owners(end) == who:
            end += 1
        for owner in who:
            run = _leading(await self.client.fetch_many(owner, hashes[start:end]))
            if run:
                return run
        return []


@dataclass
class L3Source:
    """Object storage by chunk key (GETs in threads: the S3 client is sync).

    The window's chunk is asked by the key of its last block as far as the chain's hashes go
    (or of the last block the cache index says L3 holds, `known_end`); a chain stored shorter
    ends in a partial chunk keyed by its own last block, so with `search_partial`, once the
    chain is known to reach this window, a miss tries every shorter end at once.
    `object_key(p)`: an L3 object a handle names for position p, asked first.
    """

    store: L3Store
    namespace: str
    search_partial: bool
    known_end: Callable[[], Awaitable[int | None]] | None = None  # blocks L3 holds per the index; None: unknown
    object_key: Callable[[int], str] | None = None
    tier: Tier = Tier.L3

    async def fetch(self, hashes: Sequence[bytes], start: int, window: Window) -> list[KVBlock]:
        if self.object_key is not None and (key := self.object_key(start)):
            run = await asyncio.to_thread(self._from_object, key, hashes, start, window.stop)
            if run:
                return run
        last = min(window.chunk_stop, len(hashes)) - 1
        end = await self.known_end() if self.known_end is not None else None
        if end is not None:
            if end <= start:
                return []  # the index knows of nothing here: no GET for a new prompt
            last = min(last, end - 1)
        run = await asyncio.to_thread(self._chunk, hashes, window, start, last)
        if run is not None:
            return run
        if not self.search_partial or last == start or not await window.prev_full:
            return []
        return await asyncio.to_thread(self._probe, hashes, window, start, last - 1)

    def _chunk(self, hashes: Sequence[bytes], w: Window, start: int, last: int) -> list[KVBlock] | None:
        """Positions start.. (< w.stop) of the chunk w.chunk_start..last, or None when L3 has no such chunk."""
        chunk = self.store.get_chunk(self.store.key(self.namespace, hashes[last]))
        first = w.chunk_start
        if isinstance(chunk, Miss) or [b.header.block_hash for b in chunk] != list(hashes[first:last + 1]):
            return None
        return [b.to_kv_block() for b in chunk[start - first:w.stop - first]]

    def _probe(self, hashes: Sequence[bytes], w: Window, start: int, highest: int) -> list[KVBlock]:
        """The longest chunk ending in highest..start that L3 holds, all ends asked at once."""
        ends = list(range(highest, start - 1, -1))
        with ThreadPoolExecutor(max_workers=min(len(ends), _PROBE_THREADS)) as pool:
            runs = list(pool.map(lambda end: self._chunk(hashes, w, start, end), ends))
        return next((run for run in runs if run is not None), [])

    def _from_object(self, key: str, hashes: Sequence[bytes], start: int, stop: int) -> list[KVBlock]:
        chunk = self.store.get_chunk(key)
        if isinstance(chunk, Miss):
            return []
        at = {b.header.block_hash: i for i, b in enumerate(chunk)}
        i = at.get(hashes[start])
        run = []
        for p in range(start, stop):
            if i is None or i >= len(chunk) or chunk[i].header.block_hash != hashes[p]:
                break
            run.append(chunk[i].to_kv_block())
            i += 1
        return run
