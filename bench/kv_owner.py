"""A worker's L2 in a process of its own, serving peers: the far side of the data-path benchmark.

Fills a `HostTier` with the benchmark's chain (`bench/kv_chain.py`), in
shared memory (`--shm`, as the local stack's workers do, so a same-host
reader maps it) or on its heap (a reader must then come over the network,
as between containers), serves it with the worker's NATS peer server, and
prints one line `ready <blocks> <bytes>` once it does. It runs until stdin
closes or it is told to stop.

    python -m kvmesh.bench.kv_owner --nats URL --worker-id ID --fingerprint FP --salt HEX \
        --context N --shape L,2,B,H,D [--seed S] [--shm]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import nats
from kvmesh.bench.kv_chain import ChainSpec, chain_blocks
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.tiers.arena import HeapArena
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.shm_slab import SlabArena
from kvmesh.transfer.peer_nats import NatsPeerServer


def fill(spec: ChainSpec, worker_id: str, shm: bool) -> HostTier:
    encoded = [encode_kv_block(kb, spec.fingerprint) for kb in chain_blocks(spec)]
    room = 2 * sum(len(e) for e in encoded)
    tier = HostTier(room, LRUPolicy(), spec.fingerprint, worker_id, SlabArena(worker_id, room) if shm else HeapArena())
    for e in encoded:
        if not tier.put_encoded(e).stored:
            raise RuntimeError("owner L2 refused a block")
    return tier


async def serve(args: argparse.Namespace) -> None:
    spec = ChainSpec(args.fingerprint, bytes.fromhex(args.salt), args.context,
                     tuple(int(x) for x in args.shape.split(",")), args.seed)
    tier = fill(spec, args.worker_id, args.shm)
    nc = await nats.connect(args.nats, max_reconnect_attempts=0)
    server = NatsPeerServer(nc, tier, args.worker_id)
    await server.start()
    print(f"ready {len(tier)} {tier.used_bytes}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.buffer.read1(1 << 16) else None)
    await stop.wait()
    await server.stop()
    await nc.drain()
    tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--fingerprint", required=True)
    parser.add_argument("--salt", default="")
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shm", action="store_true")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
