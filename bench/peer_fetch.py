"""Peer fetch candidates side by side: NATS (one block per request, and the whole chain in one
`fetch_many`) vs HTTP GET, on loopback.

An owner L2 holds N blocks of the `small` model's shape; a client fetches all
of them (verified) with a given concurrency over each transport. Same-machine
shared-memory attach is measured too, to say whether it beats a loopback hop.
Client and owner share one process and event loop (as a worker's side server
would); nats-server is a real separate process. Prints one JSON object.

    .venv/bin/python -m kvmesh.bench.peer_fetch [--blocks 1000] [--concurrency 16]

(bench/transfer_engines.py measures the same NATS paths between two processes, at 8B geometry,
against NIXL, Mooncake, shared memory and memcpy.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nats
from fastapi import FastAPI
from kvmesh.bench.tier_blocks import small_block_shape, synthetic_chain
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.stack.servers import NatsServer
from kvmesh.tiers.block_format import decode_block, encode_kv_block
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.miss import Miss, MissCounters
from kvmesh.tiers.shm_slab import SlabArena, SlabReader
from kvmesh.transfer.peer_http import HttpPeerClient, peer_router, serve_in_loop
from kvmesh.transfer.peer_nats import NatsPeerClient, NatsPeerServer
from rich.console import Console
from rich.progress import Progress

FP = "bench-peer-fetch"


async def _fetch_all(client, hashes: list[bytes], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(h: bytes) -> None:
        async with sem:
            got = await client.fetch("owner", h)
            if isinstance(got, Miss):
                raise RuntimeError(f"fetch missed: {got}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(h) for h in hashes))
    return time.perf_counter() - t0


def _rate(n: int, nbytes: int, seconds: float) -> dict:
    return {"seconds": round(seconds, 4), "blocks_per_s": round(n / seconds, 1), "MBps": round(nbytes / seconds / 1e6, 1)}


async def run(blocks_n: int, concurrency: int, progress: Progress) -> dict:
    shape = small_block_shape()
    blocks = synthetic_chain(blocks_n, shape)
    hashes = [b.block_hash for b in blocks]
    owner = HostTier(1 << 40, LRUPolicy(), FP, "owner")
    shm_worker = f"bench-owner-{os.getpid()}"  # slab names are per machine: keep runs apart
    room = 2 * blocks_n * len(encode_kv_block(blocks[0], FP))
    shm_owner = HostTier(room, LRUPolicy(), FP, shm_worker, arena=SlabArena(shm_worker, room))
    task = progress.add_task("filling L2", total=2 * blocks_n)
    for b in blocks:
        owner.put_block(b)
        shm_owner.put_block(b)
        progress.advance(task, 2)
    nbytes = owner.used_bytes
    result: dict = {"blocks": blocks_n, "block_bytes": nbytes // blocks_n, "block_shape": list(shape),
                    "concurrency": concurrency}

    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(data_dir=Path(tmp) / "nats")
        server.start()
        nc = await nats.connect(server.url)
        try:
            responder = NatsPeerServer(nc, owner, "owner")
            nclient = NatsPeerClient(nc, FP, MissCounters(), timeout_s=30)
            await responder.start()
            await nclient.start()
            progress.update(task, description="NATS fetch", completed=0, total=2)
            await _fetch_all(nclient, hashes[:50], concurrency)  # warm up
            result["nats"] = _rate(blocks_n, nbytes, await _fetch_all(nclient, hashes, concurrency))
            result["nats_sequential"] = _rate(blocks_n, nbytes, await _fetch_all(nclient, hashes, 1))
            t0 = time.perf_counter()
            if any(isinstance(g, Miss) for g in await nclient.fetch_many("owner", hashes)):
                raise RuntimeError("fetch_many missed")
            result["nats_batch"] = _rate(blocks_n, nbytes, time.perf_counter() - t0)
            progress.advance(task)
            await nclient.close()
        finally:
            await nc.close()
            server.stop()

    app = FastAPI()
    app.include_router(peer_router(owner))
    async with serve_in_loop(app) as url:
        hclient = HttpPeerClient(lambda worker: url, FP, MissCounters(), timeout_s=30, max_connections=concurrency)
        progress.update(task, description="HTTP fetch")
        await _fetch_all(hclient, hashes[:50], concurrency)
        result["http"] = _rate(blocks_n, nbytes, await _fetch_all(hclient, hashes, concurrency))
        result["http_sequential"] = _rate(blocks_n, nbytes, await _fetch_all(hclient, hashes, 1))
        progress.advance(task)
        await hclient.close()

    t0 = time.perf_counter()
    reader = SlabReader()
    for h in hashes:  # another process would do exactly this: find in the slab, copy out, verify
        decode_block(reader.read(shm_worker, h), FP, h)
    reader.close()
    result["shm_read"] = _rate(blocks_n, nbytes, time.perf_counter() - t0)
    shm_owner.close()
    owner.close()

    result["http_vs_nats"] = round(result["nats"]["seconds"] / result["http"]["seconds"], 3)
    result["http_vs_nats_sequential"] = round(result["nats_sequential"]["seconds"] / result["http_sequential"]["seconds"], 3)
    result["shm_vs_http"] = round(result["http"]["seconds"] / result["shm_read"]["seconds"], 2)
    result["nats_batch_vs_nats"] = round(result["nats"]["seconds"] / result["nats_batch"]["seconds"], 2)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args(argv)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        result = asyncio.run(run(args.blocks, args.concurrency, progress))
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
