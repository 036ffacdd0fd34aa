"""The services under test in `kvmesh bench fleet`, each in its own process as deployed.

- `index_main`: one cache-index replica (`CacheIndex`, heartbeat watch on),
  answering `INDEX_LOOKUP` in its queue group; on `STATS` it says how far
  it has applied KV_EVENTS, how many blocks it holds and its RSS (asked
  `nbytes`, also the bytes of the map itself).
- `eviction_main`: the eviction service (`EvictionService`, no L3) with the
  emulated workers' L1 capacity; its advice goes to the workers' commands.
- `ingress_main`: the routing half of an ingress: a `WorkerTable` fed by the
  heartbeat watch, `lookup_prefix` over NATS and `Router.pick_prefill`.
  It replays the trace at `speed` x its timestamps, routing each request
  and telling the emulator (`ASSIGN`) which worker runs it; the request
  counts as in flight on that worker for its modeled prefill time
  (`prefill_s_per_token` x its tokens / `speed`), as the ingress counts
  it, so load spreads the fleet. Meanwhile it probes at `lookup_rate`
  (lookup + routing decision, nothing assigned).
Each puts "ready" (then, for the ingress, its samples) on its queue.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from multiprocessing.queues import Queue

from kvmesh.bus.connection import connect
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import serve
from kvmesh.cache_index.client import lookup_prefix
from kvmesh.cache_index.messages import LookupReply, LookupRequest
from kvmesh.cache_index.service import CacheIndex
from kvmesh.config import BusSettings, EvictionSettings, IndexSettings, IngressSettings
from kvmesh.eviction.service import EvictionService
from kvmesh.ingress.routing.router import Router
from kvmesh.ingress.routing.workers import WorkerTable
from kvmesh.log import configure_logging
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import Role
from kvmesh.service.heap import freeze_startup_heap

STATS = "bench.fleet.index.stats"
ASSIGN = "bench.fleet.assign"
BLOCK_TOKENS = 512  # Mooncake's block size


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def index_main(url: str, out: Queue) -> None:
    configure_logging("warning")
    asyncio.run(_index(url, out))


async def _index(url: str, out: Queue) -> None:
    nc = await connect(url, "cache-index", BusSettings())
    js = nc.jetstream()
    index = CacheIndex(nc, js, IndexSettings(snapshot_every_events=10**12, snapshot_every_s=10**6,
                                             snapshot_name="fleet-bench"))
    await index.start()
    handled: list[float] = []  # this process's CPU time per lookup (the handler: parse, walk, reply model)
    spans: list[tuple[float, float]] = []  # (start, end) of each lookup handler, on the machine's monotonic clock

    async def lookup(req: LookupRequest) -> LookupReply:
        t, start = time.thread_time(), time.monotonic()
        reply = await index.lookup(req)
        handled.append(time.thread_time() - t)
        spans.append((start, time.monotonic()))
        return reply

    await serve(nc, subjects.INDEX_LOOKUP, LookupRequest, lookup, queue="cache-index")

    async def stats(msg) -> None:
        s = index.state
        await msg.respond(json.dumps({"stream_seq": s.stream_seq, "events_applied": s.events_applied,
                                      "blocks": len(s.index), "rss": rss_bytes(),
                                      **({"nbytes": s.index.nbytes(), "handled": handled, "spans": spans}
                                         if msg.data == b"nbytes" else {})}).encode())

    await nc.subscribe(STATS, cb=stats)
    await nc.flush()  # the server has our subscriptions before the bench asks (else: no responders)
    freeze_startup_heap()  # as ServiceRunner does once a service is up
    out.put("ready")
    await asyncio.Event().wait()  # until the bench terminates this process


def eviction_main(url: str, l1_blocks: int, tick_s: float, out: Queue) -> None:
    configure_logging("warning")
    asyncio.run(_eviction(url, l1_blocks, tick_s, out))


async def _eviction(url: str, l1_blocks: int, tick_s: float, out: Queue) -> None:
    nc = await connect(url, "eviction", BusSettings())
    js = nc.jetstream()
    settings = EvictionSettings(tick_s=tick_s)
    service = EvictionService(nc, js, Publisher(js, BusSettings()), settings, l1_blocks)
    await service.start()
    await nc.flush()
    freeze_startup_heap()
    out.put("ready")
    await asyncio.Event().wait()


def ingress_main(url: str, workers: int, trace: list[tuple[float, int, list[bytes]]], speed: float,
                 lookup_rate: float, seed: int, out: Queue) -> None:
    configure_logging("warning")
    out.put(asyncio.run(_ingress(url, workers, trace, speed, lookup_rate, seed, out)))


async def _ingress(url: str, workers: int, trace: list[tuple[float, int, list[bytes]]], speed: float,
                   lookup_rate: float, seed: int, out: Queue) -> dict:
    nc = await connect(url, "ingress", BusSettings())
    table = WorkerTable()
    follow = asyncio.create_task(table.run(nc.jetstream()))
    while len(table.live(Role.PREFILL)) < workers:
        await table.wait_for(Role.PREFILL, 1.0)
        await asyncio.sleep(0.05)
    settings = IngressSettings()
    router = Router.of(table, settings)
    lookups: list[float] = []
    round_trips: list[tuple[float, float]] = []  # (sent, answered), monotonic: matched to the index's spans
    decisions: list[float] = []
    failed = [0]

    async def route(prompt_tokens: int, chain: list[bytes]) -> str | None:
        t = time.monotonic()
        reply = await lookup_prefix(nc, chain, timeout_s=2.0)
        t1 = time.monotonic()
        worker = router.pick_prefill(prompt_tokens, BLOCK_TOKENS, reply)
        decisions.append(time.perf_counter() - t1)
        if reply is None:
            failed[0] += 1
        else:
            lookups.append(t1 - t)
            round_trips.append((t, t1))
        return worker

    async def replay_one(i: int, prompt_tokens: int, chain: list[bytes]) -> None:
        worker = await route(prompt_tokens, chain)
        if worker is not None:
            table.acquire(worker)
            await nc.publish(ASSIGN, json.dumps({"i": i, "w": worker}).encode())
            await asyncio.sleep(prompt_tokens * settings.prefill_s_per_token / speed)
            table.release(worker)

    async def probe(stop: asyncio.Event) -> int:
        rng, n, start = random.Random(seed), 0, time.perf_counter()
        while not stop.is_set():
            _, tokens, chain = rng.choice(trace)
            await route(tokens, chain)
            n += 1
            await asyncio.sleep(max(0.0, start + n / lookup_rate - time.perf_counter()))
        return n

    freeze_startup_heap()
    out.put("ready")
    stop = asyncio.Event()
    prober = asyncio.create_task(probe(stop)) if lookup_rate > 0 else None
    t0, tasks = time.perf_counter(), []
    for i, (ts, tokens, chain) in enumerate(trace):
        await asyncio.sleep(max(0.0, t0 + ts / speed - time.perf_counter()))
        tasks.append(asyncio.create_task(replay_one(i, tokens, chain)))
    await asyncio.gather(*tasks)
    replay_s = time.perf_counter() - t0
    stop.set()
    probes = await prober if prober is not None else 0
    await nc.flush()
    follow.cancel()
    await nc.close()
    return {"lookups": lookups, "round_trips": round_trips, "decisions": decisions, "lookup_failures": failed[0],
            "replay_s": replay_s, "probes": probes, "probe_rate": probes / replay_s if replay_s else 0.0}
