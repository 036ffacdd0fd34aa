"""`python -m kvmesh.services.cache_index` as a process: ready, lookups, SIGTERM -> snapshot, restart -> snapshot + replay."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
from bus.helpers import FAST_BUS, connected, eventually, unique
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import request
from kvmesh.cache_index.messages import LookupReply, LookupRequest
from kvmesh.config import IndexSettings
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.metrics import ServiceMetrics
from kvmesh.net import free_port
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.messages import Role
from kvmesh.service.heartbeat import HeartbeatLoop

from .test_service import chain


def _start(url: str, port: int, snap: str) -> subprocess.Popen:
    env = {**os.environ, "KVMESH_NATS_URL": url, "KVMESH_SERVICE__HTTP_PORT": str(port),
           "KVMESH_SERVICE__WORKER_ID": unique("idx"), "KVMESH_INDEX__SNAPSHOT_NAME": snap,
           "KVMESH_SERVICE__HEARTBEAT_INTERVAL_S": "0.3", "KVMESH_SERVICE__HEARTBEAT_TTL_S": "2",
           "KVMESH_LOG_LEVEL": "info"}
    return subprocess.Popen([sys.executable, "-m", "kvmesh.services.cache_index"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


async def _ready(proc: subprocess.Popen, port: int) -> None:
    async def ok() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            async with httpx.AsyncClient() as http:
                return (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    await eventually(ok, 60, "the cache index's /readyz")  # generous: imports on a loaded machine


async def _stop(proc: subprocess.Popen) -> list[dict]:
    proc.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(proc.wait, 20)
    except subprocess.TimeoutExpired:
        proc.kill()  # its log says which step of the drain it was in
        code = None
    err = proc.stderr.read()
    assert code == 0, err[-4000:]
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


async def test_process_snapshots_on_sigterm_and_restarts_from_it(fresh_nats_server):
    url, snap, worker = fresh_nats_server.url, unique("snap"), unique("w")
    blocks = chain(30, "proc")
    query = LookupRequest(hashes=[h.hex() for h in blocks])
    async with connected(url, "worker") as nc:
        beat = HeartbeatLoop(nc.jetstream(), worker, Role.DECODE, "http://127.0.0.1:1", interval_s=0.5, ttl_s=5.0,
                             metrics=ServiceMetrics.create("test"))  # alive: the index keeps its blocks
        beating = asyncio.create_task(beat.run())
        events = KVEventPublisher(Publisher(nc.jetstream(), FAST_BUS), worker, IndexSettings(flush_interval_s=0.01))
        await events.start(nc)
        events.stored(blocks, Tier.L1, tokens_per_block=16)
        await events.flushed()
        procs: list[subprocess.Popen] = []
        try:
            port = free_port()
            procs.append(first := _start(url, port, snap))
            await _ready(first, port)

            async def held() -> int:
                reply = await request(nc, subjects.INDEX_LOOKUP, query, LookupReply, timeout_s=2.0)
                return {m.worker: m.blocks for m in reply.workers}.get(worker, 0)

            await eventually(lambda: _is(held(), 30), 10, "indexed by the process")
            logs = await _stop(first)
            assert any(r["event"] == "index snapshot written" and r["blocks"] == 30 for r in logs)
            events.removed(blocks[10:], Tier.L1)  # while no index runs: only the replay can carry it
            await events.flushed()
            port = free_port()
            procs.append(second := _start(url, port, snap))
            await _ready(second, port)
            await eventually(lambda: _is(held(), 10), 10, "snapshot + replayed removal")
            logs = await _stop(second)
            assert any(r["event"] == "index snapshot loaded" and r["blocks"] == 30 for r in logs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        await events.stop()
        beat.stop()
        await beating


async def _is(value, want) -> bool:
    return (await value) == want
