"""What one heartbeat costs a process that watches the `workers` bucket, layer by layer.

Every watcher (cache index, eviction, each ingress) takes every heartbeat
of the fleet. Against a nats-server started in a temp dir (the stack's
flags), a child process writes heartbeats of `workers` ids at the fleet's
keep-alive rate (each id every `period_s`), and this process receives them
through one layer at a time, for `window_s` each, measuring its own CPU
time (`time.process_time`) per message received:
- `core_subscription`: a plain NATS subscription on the bucket's subjects:
  what any message costs nats-py and the event loop (wake-up, read, parse,
  dispatch), the floor of every layer below;
- `ordered_consumer`: a JetStream ordered push consumer with a callback;
- `kv_watcher`: nats-py's `KeyValue.watchall()` iterated (what
  `watch_workers` is built on);
- `watch_workers`: kvmesh's `watch_workers(updates=True)` (the lapse clock,
  the heartbeat parsed, an UPDATE per heartbeat), as the index and the
  ingress run it.
`parse_only` is `Heartbeat.from_bytes` alone, in a loop. The ratios divide
each layer by the core subscription: what lies above nats-py's own cost.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from kvmesh.bus.connection import close, connect
from kvmesh.config import BusSettings
from kvmesh.log import configure_logging
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import Heartbeat, Role
from kvmesh.protocol.streams import declare_all
from kvmesh.service.watch import watch_workers
from kvmesh.stack.servers import NatsServer
from nats.js import api
from rich.console import Console
from rich.progress import Progress

LAYERS = ("core_subscription", "ordered_consumer", "kv_watcher", "watch_workers")


@dataclass(slots=True)
class HeartbeatWatchBenchConfig:
    workers: int = 1000
    period_s: float = 5.0 / 3  # the default keep-alive: a third of the 5 s TTL
    window_s: float = 8.0  # measured per layer, after 1 s of warm-up


def heartbeat(worker_id: str, started_at: datetime) -> Heartbeat:
    """An idle prefill worker's heartbeat, as `HeartbeatLoop` writes it."""
    return Heartbeat(worker_id=worker_id, role=Role.PREFILL, load=0.0, capacity=4.0, started_at=started_at,
                     http_endpoint="http://127.0.0.1:9", seq=1, ttl_s=5.0, kv_epoch=1, kv_seq=5,
                     l1_capacity_blocks=256)


async def write_heartbeats(url: str, workers: int, period_s: float, duration_s: float) -> int:
    """Each id's heartbeat every `period_s`, spread evenly; returns the writes made."""
    nc = await connect(url, "heartbeat-writer", BusSettings())
    js = nc.jetstream()
    now = datetime.now(UTC)
    bodies = [heartbeat(f"w{i}", now).to_bytes() for i in range(workers)]
    step, t0, k = period_s / workers, time.monotonic(), 0
    while time.monotonic() - t0 < duration_s:
        await js.publish(subjects.heartbeat_key(f"w{k % workers}"), bodies[k % workers], msg_ttl=5)
        k += 1
        ahead = t0 + k * step - time.monotonic()
        if ahead > 0:
            await asyncio.sleep(ahead)
    await close(nc)
    return k


async def _receive(url: str, layer: str, window_s: float) -> dict:
    nc = await connect(url, f"watch-{layer}", BusSettings())
    js = nc.jetstream()
    got = [0]

    async def count(_msg) -> None:
        got[0] += 1

    async def iterate(items) -> None:
        async for _ in items:
            got[0] += 1

    task = None
    if layer == "core_subscription":
        await nc.subscribe(f"$KV.{subjects.WORKERS_BUCKET}.>", cb=count)
    elif layer == "ordered_consumer":
        await js.subscribe(f"$KV.{subjects.WORKERS_BUCKET}.>", cb=count, ordered_consumer=True, idle_heartbeat=5.0,
                           config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW))
    elif layer == "kv_watcher":
        task = asyncio.create_task(iterate(await (await js.key_value(subjects.WORKERS_BUCKET)).watchall()))
    else:
        task = asyncio.create_task(iterate(watch_workers(js, updates=True)))
    await asyncio.sleep(1.0)  # the snapshot of a watch, connection set-up
    n0, cpu0 = got[0], time.process_time()
    await asyncio.sleep(window_s)
    n, cpu = got[0] - n0, time.process_time() - cpu0
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await close(nc)
    return {"messages": n, "cpu_us_per_message": round(cpu / max(n, 1) * 1e6, 1)}


def _parse_us(n: int = 20_000) -> float:
    body = heartbeat("w0", datetime.now(UTC)).to_bytes()
    t0 = time.process_time()
    for _ in range(n):
        Heartbeat.from_bytes(body)
    return round((time.process_time() - t0) / n * 1e6, 2)


async def _run(cfg: HeartbeatWatchBenchConfig, server: NatsServer) -> dict:
    nc = await connect(server.url, "declare", BusSettings())
    await declare_all(nc.jetstream())
    await close(nc)
    duration = len(LAYERS) * (cfg.window_s + 2.0) + 2.0
    writer = subprocess.Popen([sys.executable, "-m", "kvmesh.bench.heartbeat_watch", server.url, str(cfg.workers),
                               str(cfg.period_s), str(duration)], stdout=subprocess.PIPE, text=True)
    layers: dict[str, dict] = {}
    try:
        await asyncio.sleep(1.0)
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("heartbeat watch layers", total=len(LAYERS))
            for layer in LAYERS:
                progress.update(task, description=f"{layer} ({cfg.window_s:g} s)")
                layers[layer] = await _receive(server.url, layer, cfg.window_s)
                progress.advance(task)
    except BaseException:
        writer.kill()
        raise
    writes = int(writer.communicate(timeout=duration + 60)[0].strip() or 0)
    floor = layers["core_subscription"]["cpu_us_per_message"] or 1.0
    return {
        "config": {"workers": cfg.workers, "period_s": round(cfg.period_s, 3), "window_s": cfg.window_s,
                   "heartbeats_per_s": round(cfg.workers / cfg.period_s, 1), "writes": writes},
        "layers": layers,
        "parse_only_us": _parse_us(),
        "ratio_to_core_subscription": {k: round(v["cpu_us_per_message"] / floor, 2) for k, v in layers.items()},
        "watcher_core_share_at_rate": round(layers["watch_workers"]["cpu_us_per_message"] * 1e-6
                                            * cfg.workers / cfg.period_s, 3),
    }


def run_heartbeat_watch_bench(cfg: HeartbeatWatchBenchConfig) -> dict:
    configure_logging("warning")  # logs to stderr, never into the JSON on stdout
    with tempfile.TemporaryDirectory(prefix="kvmesh-hbwatch-") as tmp:
        server = NatsServer(Path(tmp) / "nats")
        server.start()
        try:
            return asyncio.run(_run(cfg, server))
        finally:
            server.stop()


if __name__ == "__main__":  # the writer child: url, workers, period_s, duration_s
    configure_logging("warning")
    print(asyncio.run(write_heartbeats(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))))
