"""Bus throughput side by side: what the backbone's guarantees cost on a real nats-server.

Against a nats-server started in a temp dir with the stack's flags
(JetStream, `sync_interval: always`):
- `publish`: `Publisher.publish` (Nats-Msg-Id, stream ack) sequentially and
  from 8 / 64 concurrent tasks, vs a core NATS publish; ratios are msgs/s
  over the sequential JetStream rate.
- `consume`: `ConsumerLoop` handling a backlog with fetch batch 1 vs 16
  (explicit confirmed acks).
- `request`: typed `request()` (pydantic in/out) vs raw `nc.request` round trips.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bus.connection import connect
from kvmesh.bus.consumer import ConsumerLoop
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import request, serve
from kvmesh.config import BusSettings
from kvmesh.log import configure_logging
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import ErrorReply
from kvmesh.protocol.streams import JOBS, ConsumerSpec, declare_all
from kvmesh.stack.servers import NatsServer
from rich.console import Console
from rich.progress import Progress


@dataclass(slots=True)
class BusBenchConfig:
    messages: int = 1000
    payload_bytes: int = 64


async def _rate(n: int, body: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await body()
    return round(n / (time.perf_counter() - t0), 1)


async def _publish(nc, cfg: BusBenchConfig) -> dict:
    pub = Publisher(nc.jetstream(), BusSettings())
    data = b"x" * cfg.payload_bytes
    n = cfg.messages
    out: dict[str, float] = {}

    async def sequential() -> None:
        for i in range(n):
            await pub.publish(subjects.kv_events("bench-seq"), data, msg_id=f"seq-{i}")

    out["jetstream_sequential_msgs_s"] = await _rate(n, sequential)
    for conc in (8, 64):
        sem = asyncio.Semaphore(conc)

        async def one(i: int, conc: int = conc, sem: asyncio.Semaphore = sem) -> None:
            async with sem:
                await pub.publish(subjects.kv_events(f"bench-c{conc}"), data, msg_id=f"c{conc}-{i}")

        async def concurrent(conc: int = conc, one: Callable[[int], Awaitable[None]] = one) -> None:
            await asyncio.gather(*(one(i) for i in range(n)))

        out[f"jetstream_{conc}_concurrent_msgs_s"] = await _rate(n, concurrent)

    async def core() -> None:
        for _ in range(n):
            await nc.publish("kvmesh.bench.core", data)
        await nc.flush()

    out["core_nats_msgs_s"] = await _rate(n, core)
    base = out["jetstream_sequential_msgs_s"]
    out["ratio_8_concurrent_vs_sequential"] = round(out["jetstream_8_concurrent_msgs_s"] / base, 3)
    out["ratio_64_concurrent_vs_sequential"] = round(out["jetstream_64_concurrent_msgs_s"] / base, 3)
    out["ratio_core_vs_jetstream"] = round(out["core_nats_msgs_s"] / base, 1)
    return out


async def _consume(nc, cfg: BusBenchConfig) -> dict:
    js = nc.jetstream()
    out: dict[str, float] = {}
    for batch in (1, 16):
        worker = f"bench-b{batch}-{time.monotonic_ns()}"
        subject = subjects.jobs_prefill(worker)
        futures = [await js.publish_async(subject, b"j") for _ in range(cfg.messages)]
        await asyncio.gather(*futures)
        done = asyncio.Event()
        handled = 0

        async def handle(_msg) -> None:
            nonlocal handled
            handled += 1
            if handled == cfg.messages:
                done.set()

        metrics = ServiceMetrics.create("bench")
        loop = ConsumerLoop(js, ConsumerSpec(JOBS.name, f"prefill-{worker}", subject), handle,
                            Publisher(js, BusSettings()), metrics, BusSettings(fetch_batch=batch))
        t0 = time.perf_counter()
        task = asyncio.create_task(loop.run())
        await done.wait()
        out[f"batch{batch}_msgs_s"] = round(cfg.messages / (time.perf_counter() - t0), 1)
        loop.stop()
        await task
        await js.delete_consumer(JOBS.name, f"prefill-{worker}")
    out["ratio_batch16_vs_batch1"] = round(out["batch16_msgs_s"] / out["batch1_msgs_s"], 3)
    return out


async def _request(nc, cfg: BusBenchConfig) -> dict:
    subject = "kvmesh.bench.echo"

    async def echo(req: ErrorReply) -> ErrorReply:
        return req

    sub = await serve(nc, subject, ErrorReply, echo, queue="bench")
    msg = ErrorReply(error="x" * cfg.payload_bytes)
    raw = msg.to_bytes()

    async def typed() -> None:
        for _ in range(cfg.messages):
            await request(nc, subject, msg, ErrorReply, timeout_s=5)

    async def untyped() -> None:
        for _ in range(cfg.messages):
            await nc.request(subject, raw, timeout=5)

    out = {"typed_rps": await _rate(cfg.messages, typed), "raw_rps": await _rate(cfg.messages, untyped)}
    out["ratio_typed_vs_raw"] = round(out["typed_rps"] / out["raw_rps"], 3)
    await sub.drain()
    return out


async def _run(url: str, cfg: BusBenchConfig, progress: Progress) -> dict:
    nc = await connect(url, "bench-bus")
    try:
        await declare_all(nc.jetstream())
        task = progress.add_task("publish", total=3)
        result = {"publish": await _publish(nc, cfg)}
        progress.update(task, advance=1, description="consume")
        result["consume"] = await _consume(nc, cfg)
        progress.update(task, advance=1, description="request/reply")
        result["request"] = await _request(nc, cfg)
        progress.update(task, advance=1)
        return result
    finally:
        await nc.close()


def run_bus_bench(cfg: BusBenchConfig) -> dict:
    configure_logging("warning")  # logs to stderr, never into the JSON on stdout
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console, transient=True) as progress:
        server = NatsServer(data_dir=Path(tmp) / "nats")
        server.start()
        try:
            result = asyncio.run(_run(server.url, cfg, progress))
        finally:
            server.stop()
    result["config"] = {"messages": cfg.messages, "payload_bytes": cfg.payload_bytes, "sync_interval": "always"}
    return result
