"""Does the cache index hold what the workers really hold? And the KV-event faults that test it.

The index's view comes from a snapshot it writes on request (the whole map,
exactly as it answers lookups); each worker's truth from the same state dump
the index itself uses to repair gaps. Both are read while the system keeps
running, so the check retries until they agree or its deadline passes: that
bounded wait is the convergence the invariant promises.
"""

from __future__ import annotations

import asyncio
import time

import nats
from kvmesh.bus.request import request
from kvmesh.cache_index import snapshot
from kvmesh.cache_index.index import keys_of
from kvmesh.cache_index.messages import SnapshotReply, SnapshotRequest
from kvmesh.chaos.stack import nats_client
from kvmesh.kv_events.dump import DumpError, fetch_dump
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.streams import KV_EVENTS
from nats.js import JetStreamContext

SNAPSHOT_NAME = "index"  # IndexSettings.snapshot_name's default: the chaos stack keeps it


async def disagreements(nats_urls: list[str], workers: tuple[str, ...]) -> dict[str, int]:
    """Per worker: (block, tier) entries on which the index and the worker's own state differ."""
    async with nats_client(nats_urls) as nc:
        js = nc.jetstream()
        await request(nc, subjects.INDEX_SNAPSHOT, SnapshotRequest(), SnapshotReply, timeout_s=10.0)
        blob = await snapshot.load(js, SNAPSHOT_NAME)
        if blob is None:
            raise RuntimeError("the index wrote no snapshot")
        index = snapshot.decode(blob).index
        out: dict[str, int] = {}
        for worker in workers:
            truth = await fetch_dump(nc, worker, timeout_s=5.0)
            out[worker] = sum(len(set(keys_of(hashes)) ^ index.worker_keys(worker, tier))
                              for tier, hashes in ((Tier.L1, truth.l1), (Tier.L2, truth.l2)))
        return out


def index_converged(nats_urls: list[str], workers: tuple[str, ...], timeout_s: float = 30.0) -> bool:
    """The index agrees with every worker within `timeout_s` (the system keeps running meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if not any(asyncio.run(disagreements(nats_urls, workers)).values()):
                return True
        except (DumpError, RuntimeError, nats.errors.Error, OSError):
            pass  # a worker or the index not answering yet
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def last_event_seq(nats_urls: list[str]) -> int:
    async def go() -> int:
        async with nats_client(nats_urls) as nc:
            return int((await nc.jetstream().stream_info(KV_EVENTS.name)).state.last_seq)

    return asyncio.run(go())


def drop_and_duplicate(nats_urls: list[str], after_seq: int) -> tuple[int, int]:
    """Of the KV event batches stored after `after_seq`: delete every other one, publish the rest twice.

    What a lossy path does to events: the index must see the gaps (from later events or from the
    workers' heartbeats), repair them by state dumps, and ignore the duplicates. Returns (dropped, duplicated).
    """
    async def go() -> tuple[int, int]:
        async with nats_client(nats_urls) as nc:
            js = nc.jetstream()
            last = int((await js.stream_info(KV_EVENTS.name)).state.last_seq)
            dropped = duplicated = 0
            for seq in range(after_seq + 1, last + 1):
                if (seq - after_seq) % 2:
                    dropped += await _delete(js, seq)
                else:
                    duplicated += await _republish(js, seq)
            return dropped, duplicated

    return asyncio.run(go())


async def _delete(js: JetStreamContext, seq: int) -> int:
    try:
        return int(await js.delete_msg(KV_EVENTS.name, seq))
    except nats.js.errors.NotFoundError:
        return 0


async def _republish(js: JetStreamContext, seq: int) -> int:
    try:
        msg = await js.get_msg(KV_EVENTS.name, seq)
    except nats.js.errors.NotFoundError:
        return 0
    await js.publish(msg.subject, msg.data or b"")  # no Nats-Msg-Id: the stream keeps the copy
    return 1
