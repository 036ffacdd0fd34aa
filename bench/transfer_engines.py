"""DRAM-to-DRAM between two processes on this host: the candidate peer data paths side by side.

An owner process holds `--mib` of KV blocks (`--block-mib` each, the Llama-3-8B
block: 16 tokens x 128 KiB); a reader process moves all of them into its own
memory. Paths:

    memcpy            numpy copy in one process: the reference every ratio is against
    shm_copy          POSIX shared memory, the reader copies out (same host only)
    kvmesh_shm        ShmPeerClient.fetch_many over the owner's SlabArena: copy out + verify (same host only)
    nats_per_block    NatsPeerClient.fetch per block, 1 MiB messages, on nats-py (the path before #11)
    nats_batch_natspy NatsPeerClient.fetch_many of the whole chain, max_payload messages, on nats-py
    nats_batch        the same on the lean wire (shared/transfer/nats_wire.py): what workers use
    nixl_ucx          NIXL READ, UCX as it picks transports (cma zero-copy on one host), UCX_NET_DEVICES=lo
    nixl_ucx_tcp      NIXL READ, UCX_TLS=tcp (what UCX does between hosts without RDMA)
    mooncake_tcp      Mooncake Transfer Engine READ over TCP, P2P handshake

The kvmesh paths verify every block (xxh3 + header); the engines move raw bytes.
Optional engines are measured when they import, else reported with the exact error.
Mooncake binds every interface, so it runs only where loopback is the only one
(`unshare -n` gives such a namespace); elsewhere it is reported as skipped.
Prints one JSON object: GB/s per path (median of `--reps`) and its ratio to memcpy.

    .venv/bin/python -m kvmesh.bench.transfer_engines [--mib 256] [--block-mib 2] [--reps 3] [--only nats_batch,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

MIB = 1 << 20
FP = "bench-transfer-engines"
PATHS = ("memcpy", "shm_copy", "kvmesh_shm", "nats_per_block", "nats_batch_natspy", "nats_batch", "nixl_ucx",
         "nixl_ucx_tcp", "mooncake_tcp")
NATS_PATHS = ("nats_per_block", "nats_batch_natspy", "nats_batch")
NIXL_ENV = {"nixl_ucx": {"UCX_NET_DEVICES": "lo"}, "nixl_ucx_tcp": {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}}


def _block_shape(block_mib: int) -> tuple[int, ...]:
    """Llama-3-8B per 16-token block: 32 layers x K/V x 16 x 8 heads x 128, bf16 = 2 MiB; more layers scale it."""
    return (16 * block_mib, 2, 16, 8, 128)


# --- owners (child processes): hold the data, say where it is, wait for stop ------------------------

def _owner(target: Callable, out, *args) -> None:
    """Run an owner; its failure goes to the orchestrator as the path's result instead of a hang."""
    _quiet_stdout()
    try:
        target(out, *args)
    except Exception as exc:  # noqa: BLE001 - the exact error is the result
        out.put({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=3)})


def _owner_raw(out, kind: str, nbytes: int, block: int, stop, env: dict) -> None:
    os.environ.update(env)
    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    if kind == "shm_copy":
        from multiprocessing.shared_memory import SharedMemory

        shm = SharedMemory(create=True, size=nbytes)
        np.frombuffer(shm.buf, dtype=np.uint8)[:] = buf
        out.put({"name": shm.name})
        stop.wait()
        shm.close()
        shm.unlink()
    elif kind.startswith("nixl"):
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("owner", nixl_agent_config(enable_listen_thread=False, backends=["UCX"]))
        agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
        descs = agent.get_xfer_descs([(buf.ctypes.data + i, block, 0) for i in range(0, nbytes, block)], "DRAM")
        out.put({"meta": agent.get_agent_metadata(), "descs": agent.get_serialized_descs(descs)})
        stop.wait()
    else:  # mooncake
        from mooncake.engine import TransferEngine

        engine = TransferEngine()
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        engine.register_memory(buf.ctypes.data, nbytes)
        out.put({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": buf.ctypes.data})
        stop.wait()


def _owner_kvmesh(out, kind: str, nbytes: int, block_mib: int, url: str, stop) -> None:
    import torch
    from kvmesh.cache_policy.base import LRUPolicy
    from kvmesh.engine.kv_block import KVBlock
    from kvmesh.tiers.arena import HeapArena
    from kvmesh.tiers.l2_host import HostTier
    from kvmesh.tiers.shm_slab import SlabArena

    worker = f"bench-te-{os.getpid()}"
    shape = _block_shape(block_mib)
    room = 2 * nbytes
    tier = HostTier(room, LRUPolicy(), FP, worker, SlabArena(worker, room) if kind == "kvmesh_shm" else HeapArena())
    hashes, parent = [], None
    for i in range(nbytes // (block_mib * MIB)):
        h = i.to_bytes(4, "little") * 8
        tier.put_block(KVBlock(h, parent, tuple(range(16)), torch.full(shape, float(i), dtype=torch.bfloat16)))
        hashes.append(h)
        parent = h

    async def serve() -> None:
        import nats
        from kvmesh.transfer.peer_nats import NatsPeerServer

        nc = await nats.connect(url)
        server = NatsPeerServer(nc, tier, worker, chunk_bytes=MIB if kind == "nats_per_block" else None,
                                use_wire=kind == "nats_batch")
        await server.start()
        await nc.flush()
        out.put({"worker": worker, "hashes": hashes, "bytes": tier.used_bytes})
        await asyncio.to_thread(stop.wait)
        await server.stop()
        await nc.close()

    if kind == "kvmesh_shm":
        out.put({"worker": worker, "hashes": hashes, "bytes": tier.used_bytes})
        stop.wait()
    else:
        asyncio.run(serve())
    tier.close()


# --- readers (child processes): move everything, `reps` times; return seconds per rep ----------------

def _quiet_stdout() -> None:
    """Engines log to stdout (NIXL's Python logger, UCX): in a child, stdout is stderr, so ours stays JSON."""
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def _reader(kind: str, info: dict, nbytes: int, block: int, reps: int, url: str, env: dict, out) -> None:
    _quiet_stdout()
    os.environ.update(env)
    try:
        out.put({"seconds": _READERS[kind.split("_")[0] if kind.startswith(("nixl", "nats")) else kind](
            kind, info, nbytes, block, reps, url)})
    except Exception as exc:  # noqa: BLE001 - the exact error is the result
        out.put({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=3)})


def _timed(reps: int, once: Callable[[], None]) -> list[float]:
    once()  # warm-up: connections, registrations, page faults
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        seconds.append(time.perf_counter() - t0)
    return seconds


def _read_shm(kind, info, nbytes, block, reps, url) -> list[float]:
    from multiprocessing.shared_memory import SharedMemory

    shm = SharedMemory(name=info["name"])
    dst = np.empty(nbytes, dtype=np.uint8)
    src = np.frombuffer(shm.buf, dtype=np.uint8)
    try:
        return _timed(reps, lambda: np.copyto(dst, src))
    finally:
        del src
        shm.close()


def _read_kvmesh_shm(kind, info, nbytes, block, reps, url) -> list[float]:
    from kvmesh.tiers.miss import Miss, MissCounters
    from kvmesh.transfer.peer_shm import ShmPeerClient

    client = ShmPeerClient(FP, MissCounters())

    async def fetch_all() -> None:  # returns nothing: asyncio.run on 3.11 may repr its task's result
        got = await client.fetch_many(info["worker"], info["hashes"])
        if any(isinstance(g, Miss) for g in got):
            raise RuntimeError(f"missed: {next(g for g in got if isinstance(g, Miss))}")

    return _timed(reps, lambda: asyncio.run(fetch_all()))


def _read_nats(kind, info, nbytes, block, reps, url) -> list[float]:
    import nats
    from kvmesh.tiers.miss import Miss, MissCounters
    from kvmesh.transfer.peer_nats import NatsPeerClient

    async def run() -> list[float]:
        nc = await nats.connect(url)
        client = NatsPeerClient(nc, FP, MissCounters(), timeout_s=30, use_wire=kind == "nats_batch")
        await client.start()
        seconds = []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            if kind != "nats_per_block":
                got = await client.fetch_many(info["worker"], info["hashes"])
            else:
                got = [await client.fetch(info["worker"], h) for h in info["hashes"]]
            if any(isinstance(g, Miss) for g in got):
                raise RuntimeError(f"missed: {next(g for g in got if isinstance(g, Miss))}")
            if rep:  # the first is the warm-up
                seconds.append(time.perf_counter() - t0)
        await client.close()
        await nc.close()
        return seconds

    return asyncio.run(run())


def _read_nixl(kind, info, nbytes, block, reps, url) -> list[float]:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("reader", nixl_agent_config(enable_listen_thread=False, backends=["UCX"]))
    dst = np.zeros(nbytes, dtype=np.uint8)
    agent.register_memory([(dst.ctypes.data, nbytes, 0, "")], "DRAM")
    local = agent.get_xfer_descs([(dst.ctypes.data + i, block, 0) for i in range(0, nbytes, block)], "DRAM")
    remote = agent.deserialize_descs(info["descs"])
    peer = agent.add_remote_agent(info["meta"])

    def once() -> None:
        handle = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer state {state}")

    seconds = _timed(reps, once)
    if int(dst[-1]) != int(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)[-1]):
        raise RuntimeError("NIXL READ delivered other bytes")
    return seconds


def _read_mooncake(kind, info, nbytes, block, reps, url) -> list[float]:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    dst = np.zeros(nbytes, dtype=np.uint8)
    engine.register_memory(dst.ctypes.data, nbytes)
    offsets = range(0, nbytes, block)

    def once() -> None:
        rc = engine.batch_transfer_sync_read(info["session"], [dst.ctypes.data + o for o in offsets],
                                             [info["addr"] + o for o in offsets], [block] * len(offsets))
        if rc != 0:
            raise RuntimeError(f"mooncake batch read returned {rc}")

    return _timed(reps, once)


_READERS = {"shm_copy": _read_shm, "kvmesh_shm": _read_kvmesh_shm, "nats": _read_nats, "nixl": _read_nixl,
            "mooncake_tcp": _read_mooncake}


# --- orchestration ------------------------------------------------------------------------------------

def _interfaces() -> list[str]:
    """Network interfaces of this process's namespace (sysfs may show the host's)."""
    import socket

    return sorted(name for _, name in socket.if_nameindex())


def _unavailable(kind: str) -> str | None:
    """Why `kind` cannot be measured here (None: it can)."""
    probe = {"nixl": "from nixl._api import nixl_agent", "mooncake": "from mooncake.engine import TransferEngine"}
    name = kind.split("_")[0]
    if name in probe:
        code = f"import os; os.environ.update({NIXL_ENV.get(kind, {})!r}); {probe[name]}"
        import subprocess

        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["import failed"])[-1]
    if name == "mooncake" and _interfaces() != ["lo"]:
        return "binds every interface (RPC and data ports on 0.0.0.0); run under `unshare -n` to measure on loopback"
    return None


def _pair(kind: str, args: argparse.Namespace, url: str) -> dict:
    ctx = mp.get_context("spawn")
    nbytes, block = args.mib * MIB, args.block_mib * MIB
    env = NIXL_ENV.get(kind, {})
    info_q, out_q, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    if kind == "kvmesh_shm" or kind in NATS_PATHS:
        owner = ctx.Process(target=_owner, args=(_owner_kvmesh, info_q, kind, nbytes, args.block_mib, url, stop))
    else:
        owner = ctx.Process(target=_owner, args=(_owner_raw, info_q, kind, nbytes, block, stop, env))
    owner.start()
    try:
        info = info_q.get(timeout=300)
        if "error" in info:
            return info
        moved = info.get("bytes", nbytes)
        reader = ctx.Process(target=_reader, args=(kind, info, nbytes, block, args.reps, url, env, out_q))
        reader.start()
        got = out_q.get(timeout=600)
        reader.join()
    finally:
        stop.set()
        owner.join(60)
        if owner.is_alive():
            owner.kill()
    if "error" in got:
        return got
    med = statistics.median(got["seconds"])
    return {"GBps": round(moved / med / 1e9, 3), "best_GBps": round(moved / min(got["seconds"]) / 1e9, 3),
            "seconds": [round(s, 4) for s in got["seconds"]]}


def _memcpy(args: argparse.Namespace) -> dict:
    src = np.random.default_rng(0).integers(0, 255, args.mib * MIB, dtype=np.uint8)
    dst = np.empty_like(src)
    seconds = _timed(args.reps, lambda: np.copyto(dst, src))
    med = statistics.median(seconds)
    return {"GBps": round(src.nbytes / med / 1e9, 3), "best_GBps": round(src.nbytes / min(seconds) / 1e9, 3),
            "seconds": [round(s, 4) for s in seconds]}


def run(args: argparse.Namespace) -> dict:
    from kvmesh.stack.servers import NatsServer

    wanted = [p for p in PATHS if p in args.only] if args.only else list(PATHS)
    result: dict = {"mib": args.mib, "block_mib": args.block_mib, "reps": args.reps, "cpus": os.cpu_count(),
                    "interfaces": _interfaces(), "paths": {}}
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(data_dir=Path(tmp) / "nats")
        server.start()
        try:
            result["nats_max_payload"] = server.max_payload
            for kind in wanted:
                print(f"measuring {kind}", file=sys.stderr, flush=True)
                why = None if kind == "memcpy" else _unavailable(kind)
                if why is not None:
                    result["paths"][kind] = {"skipped": why}
                    continue
                result["paths"][kind] = _memcpy(args) if kind == "memcpy" else _pair(kind, args, server.url)
        finally:
            server.stop()
    base = result["paths"].get("memcpy", {}).get("GBps")
    for kind, r in result["paths"].items():
        if base and "GBps" in r:
            r["vs_memcpy"] = round(r["GBps"] / base, 3)
    nats = {k: result["paths"].get(k, {}).get("GBps") for k in NATS_PATHS}
    if nats["nats_per_block"]:
        for k in ("nats_batch_natspy", "nats_batch"):
            if nats[k]:
                result[f"{k}_vs_per_block"] = round(nats[k] / nats["nats_per_block"], 2)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="data moved per repetition")
    ap.add_argument("--block-mib", type=int, default=2, help="one block (a transfer descriptor)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", type=lambda s: s.split(","), default=None, help=f"a subset of {','.join(PATHS)}")
    args = ap.parse_args(argv)
    json.dump(run(args), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
