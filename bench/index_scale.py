"""`kvmesh bench index --scale 1000000,3000000,10000000`: one index process at fleet size.

Each size is built in a fresh process (spawned, so its RSS is the index's
and nothing else's): `blocks` blocks in chains of `chain`, each chain in one
of `workers` workers' L1, a third of them also in another worker's L2, a
tenth in L3 (the slots span the whole fleet, so masks are as wide as a
1,000-worker fleet makes them). Measured there:
- RSS growth per 1M blocks (-> blocks per GiB) and the map's own bytes;
- CPU time per lookup of a chain (hits and misses): the walk alone, and the
  whole NATS handler (decode the request, walk, encode the reply);
- lookups over a real nats-server: a client in this (parent) process sends
  requests from `concurrency` tasks; the index process's CPU seconds per
  lookup served give lookups/s per core;
- snapshot encode/decode time and size (over 320 MiB only the projected
  size, and whether it fits the snapshot bucket's 1 GiB).
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import random
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bus.connection import close, connect
from kvmesh.bus.request import request, serve
from kvmesh.cache_index import snapshot
from kvmesh.cache_index.feeds import IndexState
from kvmesh.cache_index.index import BlockIndex, key_of
from kvmesh.cache_index.messages import LookupReply, LookupRequest
from kvmesh.config import BusSettings
from kvmesh.log import configure_logging
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.stack.servers import NatsServer

_BUCKET_MAX = 1 << 30  # the snapshot bucket's max_bytes (shared/cache_index/snapshot.py)
_MEASURED_MAX = 320 << 20  # larger blobs are projected, not built: encoding one takes minutes on 2 cores


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    sizes: tuple[int, ...] = (1_000_000, 3_000_000, 10_000_000)
    workers: int = 1000
    chain: int = 128
    lookups: int = 2000
    concurrency: int = 8
    seed: int = 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _chain_hashes(seed: int, c: int, chain: int) -> list[str]:
    return [hashlib.sha256(b"%d/%d/%d" % (seed, c, i)).hexdigest() for i in range(chain)]


def _build(cfg: ScaleConfig, blocks: int) -> BlockIndex:
    rng = random.Random(cfg.seed)
    idx = BlockIndex()
    for c in range(blocks // cfg.chain):
        # keys drawn directly (hashing 10M blocks would dominate the build); queries hash a few chains
        keys = [key_of(h) for h in _chain_hashes(cfg.seed, c, cfg.chain)] if c < 512 else \
            [rng.getrandbits(64) for _ in range(cfg.chain)]
        idx.add(f"w{rng.randrange(cfg.workers)}", Tier.L1, keys)
        if rng.random() < 0.33:
            idx.add(f"w{rng.randrange(cfg.workers)}", Tier.L2, keys[: cfg.chain // 2])
        if rng.random() < 0.1:
            idx.add("", Tier.L3, keys[cfg.chain // 2:])
    return idx


def _queries(cfg: ScaleConfig) -> list[list[str]]:
    rng = random.Random(cfg.seed + 1)
    out = []
    for i in range(cfg.lookups):
        c = _chain_hashes(cfg.seed, rng.randrange(512), cfg.chain)
        if i % 4 == 3:  # a new turn of a known conversation: a shared start, then a miss
            c = c[: cfg.chain // 4] + _chain_hashes(cfg.seed + 7, i, cfg.chain - cfg.chain // 4)
        out.append(c)
    return out


def _index_process(cfg: ScaleConfig, blocks: int, url: str, out: mp.Queue, go: mp.Queue) -> None:
    configure_logging("warning")
    rss0 = _rss()
    t = time.perf_counter()
    idx = _build(cfg, blocks)
    row: dict = {"blocks": len(idx), "build_s": round(time.perf_counter() - t, 1)}
    rss = _rss() - rss0
    row["rss_mb_per_1m_blocks"] = round(rss / len(idx) * 1e6 / 2**20, 1)
    row["blocks_per_gib"] = round(len(idx) * 2**30 / rss)
    row["map_bytes_per_block"] = round(idx.nbytes() / len(idx), 1)
    state = IndexState(index=idx)
    queries = _queries(cfg)
    wire = [LookupRequest(hashes=q).to_bytes() for q in queries]
    walk, handler = [], []
    for data in wire:
        c = time.thread_time()
        req = LookupRequest.from_bytes(data)
        keys = [key_of(h) for h in req.hashes]
        w = time.thread_time()
        result = idx.lookup(keys)
        walk.append(time.thread_time() - w)
        LookupReply.of(result, len(idx), True).to_bytes()
        handler.append(time.thread_time() - c)
    row["lookup_walk_cpu_us"] = round(sum(walk) / len(walk) * 1e6, 1)
    row["lookup_handler_cpu_us"] = round(sum(handler) / len(handler) * 1e6, 1)
    row["lookups_per_s_per_core_in_process"] = round(len(handler) / sum(handler))
    row.update(_snapshot(state))
    out.put(row)
    asyncio.run(_serve(url, state, out, go))


def _snapshot(state: IndexState) -> dict:
    idx = state.index
    top_bit = 2 * max(idx.slots.values(), default=0) + 3  # the L2 bit of the highest slot, as snapshot.py sizes it
    words = max(1, (top_bit + 63) // 64)
    projected = len(idx) * 8 * (1 + words)
    if projected > _MEASURED_MAX:
        return {"snapshot_bytes_projected": projected, "snapshot_fits_bucket": projected <= _BUCKET_MAX}
    t = time.perf_counter()
    blob = snapshot.encode(state)
    enc = time.perf_counter() - t
    t = time.perf_counter()
    snapshot.decode(blob)
    return {"snapshot_bytes": len(blob), "snapshot_encode_s": round(enc, 2),
            "snapshot_decode_s": round(time.perf_counter() - t, 2)}


async def _serve(url: str, state: IndexState, out: mp.Queue, go: mp.Queue) -> None:
    nc = await connect(url, "index-scale", BusSettings())

    async def lookup(req: LookupRequest) -> LookupReply:
        return LookupReply.of(state.index.lookup([key_of(h) for h in req.hashes]), len(state.index), True)

    await serve(nc, subjects.INDEX_LOOKUP, LookupRequest, lookup, queue="cache-index")
    await nc.flush()
    out.put(_cpu())
    await asyncio.to_thread(go.get)  # the client is done
    out.put(_cpu())
    await close(nc)


async def _client(url: str, queries: list[list[str]], concurrency: int) -> tuple[list[float], float]:
    nc = await connect(url, "index-scale-client", BusSettings())
    samples: list[float] = []
    todo = iter(queries)

    async def worker() -> None:
        for q in todo:
            t = time.perf_counter()
            await request(nc, subjects.INDEX_LOOKUP, LookupRequest(hashes=q), LookupReply, timeout_s=10.0)
            samples.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await close(nc)
    return samples, wall


def run_index_scale(cfg: ScaleConfig) -> dict:
    configure_logging("warning")
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(data_dir=Path(tmp) / "nats")
        server.start()
        try:
            for blocks in cfg.sizes:
                out, go = ctx.Queue(), ctx.Queue()
                p = ctx.Process(target=_index_process, args=(cfg, blocks, server.url, out, go), daemon=True)
                p.start()
                row = out.get(timeout=3600)
                cpu0 = out.get(timeout=600)
                samples, wall = asyncio.run(_client(server.url, _queries(cfg), cfg.concurrency))
                go.put("done")
                cpu = out.get(timeout=600) - cpu0
                p.join(60)
                s = sorted(samples)
                row["nats"] = {"p50_ms": round(s[len(s) // 2] * 1e3, 3), "p99_ms": round(s[int(len(s) * 0.99)] * 1e3, 3),
                               "lookups_per_s": round(len(s) / wall), "concurrency": cfg.concurrency,
                               "lookups_per_s_per_core": round(len(s) / cpu) if cpu else None}
                rows.append(row)
        finally:
            server.stop()
    return {"rows": rows, "config": {"workers": cfg.workers, "chain": cfg.chain, "lookups": cfg.lookups}}
