"""The paths `bench/datapath.py` times: each restores the whole chain into the engine's pool.

Each path is an async context manager that sets up what it needs (an S3
upload, an owner process) untimed and yields `run_once() -> (seconds,
blocks imported)`. Every restore is the workers' own pipeline
(`shared/serving/kv_fetch.py` `fetch_chain`: windows of one L3 chunk,
`INFLIGHT` of them on the wire while the one before is imported on the
engine thread) over one source: this worker's L2, the owner's L2 (over the
network, or its shared memory), or L3.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import nats
from kvmesh.bench.kv_chain import ChainSpec, chain_blocks
from kvmesh.config import Settings
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.kv_fetch import L2Source, L3Source, PeerSource, Source, fetch_chain
from kvmesh.serving.worker_tiers import WorkerTiers, namespace_for
from kvmesh.stack.servers import S3Server
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import MissCounters
from kvmesh.tiers.s3_client import fast_fail_client
from kvmesh.transfer.peer_nats import NatsPeerClient
from kvmesh.transfer.peer_shm import ShmPeerClient

WINDOW = 16  # blocks per window: one L3 chunk of 256 tokens at block size 16
INFLIGHT = 4  # the workers' default `resolve_inflight`
OWNER = "bench-owner"

RunOnce = Callable[[], Awaitable[tuple[float, int]]]


@dataclass(slots=True)
class Env:
    engine: EngineLoop
    spec: ChainSpec
    hashes: list[bytes]
    l2: HostTier
    nats_url: str
    s3: S3Server


async def _restore(env: Env, source: Source) -> tuple[float, int]:
    t0 = time.perf_counter()
    got = await fetch_chain(env.engine, env.hashes, 0, len(env.hashes), [source], tenant_salt=env.spec.tenant_salt,
                            lease=None, window_blocks=WINDOW, inflight=INFLIGHT)
    return time.perf_counter() - t0, len(got.hashes)


@asynccontextmanager
async def restore_l2(env: Env) -> AsyncIterator[RunOnce]:
    yield lambda: _restore(env, L2Source(env.l2))


@asynccontextmanager
async def restore_l3(env: Env) -> AsyncIterator[RunOnce]:
    client = fast_fail_client(env.s3.endpoint, env.s3.access_key, env.s3.secret_key, False)
    store = L3Store(client, "bench-restore", env.spec.fingerprint, chunk_blocks=WINDOW)
    store.ensure_bucket()
    ns = namespace_for(env.spec.tenant_salt.hex())
    for positions in store.chunk_ranges(len(env.hashes)):
        store.put_chunk(ns, [env.l2.get_encoded(env.hashes[i]) for i in positions])
    yield lambda: _restore(env, L3Source(store, ns, search_partial=False))


@asynccontextmanager
async def _owner(env: Env) -> AsyncIterator[None]:
    """Another process holding the chain in its L2 (shared-memory arena) and serving it over NATS."""
    s = env.spec
    cmd = [sys.executable, "-m", "kvmesh.bench.kv_owner", "--nats", env.nats_url, "--worker-id", OWNER,
           "--fingerprint", s.fingerprint, "--salt", s.tenant_salt.hex(), "--context", str(s.context),
           "--shape", ",".join(map(str, s.block_shape)), "--seed", str(s.seed), "--shm"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        if not line.startswith("ready"):
            raise RuntimeError(f"owner process failed to start: {line!r}")
        yield
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@asynccontextmanager
async def _owner_client(env: Env, same_host: bool) -> AsyncIterator[RunOnce]:
    """Restores from the owner process: over NATS only (as between containers or hosts), or its
    shared memory first (same host, as in the local stack)."""
    async with _owner(env):
        nc = await nats.connect(env.nats_url)
        network = NatsPeerClient(nc, env.spec.fingerprint, MissCounters(), timeout_s=60.0)
        await network.start()
        client = ShmPeerClient(env.spec.fingerprint, MissCounters(), network) if same_host else network
        try:
            yield lambda: _restore(env, PeerSource(client, lambda _: (OWNER,)))
        finally:
            await network.close()
            await nc.drain()


def restore_peer(env: Env):
    return _owner_client(env, same_host=False)


def handoff(env: Env):
    return _owner_client(env, same_host=True)


async def growing_session(env: Env, turns: int, unique_bytes: int, root: Path, on_turn: Callable[[], None]) -> dict:
    """Register a chain growing over `turns` turns through a worker's tiers (L2 + L3 upload queue).

    Each turn registers the whole chain so far, as a worker does, and waits until its full chunks
    have landed (the partial tail waits its delay: the next turn comes sooner and replaces it); the
    last tail lands at the end. Returns what reached S3.
    """
    s3 = env.s3
    settings = Settings(state_dir=root / "worker-state", s3_endpoint=s3.endpoint, s3_access_key=s3.access_key,
                        s3_secret_key=s3.secret_key)
    settings.tiers.l2_shared_memory = False
    settings.tiers.l2_capacity_bytes = 1 << 42
    settings.s3.bucket = "bench-session"
    nc = await nats.connect(env.nats_url)
    tiers = await WorkerTiers.start(settings, nc, "bench-session-worker", env.spec.fingerprint, env.spec.block_size)
    assert tiers.l3 is not None and tiers.uploads is not None
    tiers.l3.ensure_bucket()
    stats, uploads = tiers.l3.stats, tiers.uploads
    blocks = chain_blocks(env.spec)
    n = len(env.hashes)
    requests, new_chunks = [], []
    try:
        have = 0
        for t in range(1, turns + 1):
            upto = n * t // turns
            before = (stats.s3_write_requests, stats.chunks_written)
            tiers.register(env.hashes[:upto], [next(blocks) for _ in range(have, upto)], env.spec.tenant_salt.hex())
            while uploads.pending_chunks > uploads.waiting_tails:
                await asyncio.sleep(0.005)
            requests.append(stats.s3_write_requests - before[0])
            new_chunks.append(stats.chunks_written - before[1])
            have = upto
            on_turn()
        before = (stats.s3_write_requests, stats.chunks_written)
        if not await uploads.join(600):  # the last turn's tail
            raise RuntimeError("the session's uploads did not land")
        requests[-1] += stats.s3_write_requests - before[0]
        new_chunks[-1] += stats.chunks_written - before[1]
        lost = uploads.stats.chunks_lost + uploads.stats.chunks_dropped
    finally:
        await tiers.close()
        await nc.drain()
    return {
        "l3_write_amplification": round(stats.bytes_put / unique_bytes, 4),
        "l3_bytes_put": stats.bytes_put,
        "l3_unique_kv_bytes": unique_bytes,  # K/V payload of the session's blocks
        "l3_chunks_lost_or_dropped": lost,
        "l3_s3_requests_per_turn": requests,
        "l3_chunks_written_per_turn": new_chunks,
    }
