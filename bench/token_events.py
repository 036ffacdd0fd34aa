"""NATS disk writes per generated token: token events stored in a stream vs carried by core NATS only.

Against a nats-server started in a temp dir with the stack's flags
(JetStream, `sync_interval: always`), one generation of N tokens runs three
times, each with the token subject configured another way:
- `file_stream` (before issue 16): the TOKENS stream kvmesh declared, file
  storage, every event written and fsynced;
- `memory_stream`: the same stream in memory with a 1-minute max age (the
  alternative the issue names: replayable, no disk, still replicated in R3);
- `core_nats` (now): no stream; the ingress's subscription is the only reader.
The generator is the decode worker's real `TokenStream` (one token added
per engine step, the next step once the ingress-side subscriber has the
event, so N tokens are N events); the reader is a core subscription as in
`shared/ingress/supervision/request_run.py`. Measured on the nats-server process over the
run, per token: `disk_write_bytes` (`/proc/<pid>/io` `write_bytes`, what
reached the block device; 0 on tmpfs), `stored_bytes` (the stream's own
byte count), and, for scale, `all_write_calls` / `all_written_bytes`
(`syscw` / `wchar`: every write call, socket writes to the subscriber
included). A file stream stores behind the publishers (an fsync per event
caps its ingest rate), so each run waits until the stream holds every
event before reading the counters; `events_s_delivered` (to the
subscriber) and `events_s_stored` show that backlog.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bus.connection import close, connect
from kvmesh.bus.publish import Publisher
from kvmesh.config import BusSettings
from kvmesh.protocol import subjects
from kvmesh.protocol.serving import TokenEvent
from kvmesh.protocol.streams import MINUTE, StreamSpec, declare_all
from kvmesh.serving.token_stream import TokenStream
from kvmesh.stack.servers import NatsServer
from nats.js import api

# The stream as kvmesh declared it until issue 16 (shared/protocol/streams.py then).
TOKENS_BEFORE = StreamSpec("TOKENS", (subjects.TOKENS_ALL,), 10 * MINUTE, 1024 ** 3, 256 * 1024,
                           description="decode -> ingress token streams")
CONFIGS = ("file_stream", "memory_stream", "core_nats")


@dataclass(slots=True)
class TokenEventsBenchConfig:
    tokens: int = 2000


_IO_FIELDS = {"write_bytes": "disk_write_bytes", "syscw": "all_write_calls", "wchar": "all_written_bytes"}


def _io(pid: int) -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return {name: int(fields[key]) for key, name in _IO_FIELDS.items()}


async def _stored_bytes(js, how: str, events: int, deadline_s: float = 300.0) -> int:
    """Once the stream holds all `events` (a file stream ingests behind the publishers: fsync each), its bytes."""
    if how == "core_nats":
        return 0
    end = time.monotonic() + deadline_s
    while (state := (await js.stream_info(TOKENS_BEFORE.name)).state).messages < events:
        if time.monotonic() > end:
            raise RuntimeError(f"{how}: {state.messages} of {events} events stored after {deadline_s}s")
        await asyncio.sleep(0.05)
    return state.bytes


async def _declare(js, how: str) -> None:
    if how == "core_nats":
        return
    config = TOKENS_BEFORE.config()
    if how == "memory_stream":
        config.storage, config.max_age, config.duplicate_window = api.StorageType.MEMORY, 1 * MINUTE, 1 * MINUTE
    await js.add_stream(config)


async def _generate(nc, request_id: str, tokens: int) -> int:
    """One request's output, token by token, through the worker's TokenStream; returns events received."""
    got: asyncio.Queue[TokenEvent] = asyncio.Queue()

    async def on_event(msg) -> None:
        got.put_nowait(TokenEvent.from_bytes(msg.data))

    sub = await nc.subscribe(subjects.tokens(request_id), cb=on_event)
    await nc.flush()
    stream = TokenStream(Publisher(nc.jetstream(), BusSettings()), request_id, attempt=0, worker_id="bench",
                         next_seq=0, prompt_tokens=16, cached_tokens=0)
    received = 0
    for i in range(tokens - 1):
        stream.add([i % 1000], " t")
        await got.get()  # the engine's next step comes after this event is out
        received += 1
    stream.add([7], " t")
    await stream.finish("length")
    while (await got.get()).finished is False:
        received += 1
    await sub.unsubscribe()
    return received + 1


async def _measure(server: NatsServer, cfg: TokenEventsBenchConfig) -> dict:
    nc = await connect(server.url, "bench-token-events", BusSettings())
    out: dict[str, dict] = {}
    try:
        js = nc.jetstream()
        await declare_all(js)
        for how in CONFIGS:
            await _declare(js, how)
            pid = server.process.pid
            io0, t0 = _io(pid), time.perf_counter()
            events = await _generate(nc, f"bench-{how}", cfg.tokens)
            generated = time.perf_counter() - t0
            stored = await _stored_bytes(js, how, events)
            stored_s = time.perf_counter() - t0
            io1 = _io(pid)
            per = {f"{k}_per_token": round((io1[k] - io0[k]) / cfg.tokens, 2) for k in io0}
            out[how] = {"events": events, **per, "stored_bytes_per_token": round(stored / cfg.tokens, 2),
                        "events_s_delivered": round(events / generated), "events_s_stored": round(events / stored_s)
                        if how != "core_nats" else None}
            if how != "core_nats":
                await js.delete_stream(TOKENS_BEFORE.name)
    finally:
        await close(nc)
    return out


def run_token_events_bench(cfg: TokenEventsBenchConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tokens-") as tmp:
        server = NatsServer(data_dir=Path(tmp) / "nats")
        server.start()
        try:
            runs = asyncio.run(_measure(server, cfg))
        finally:
            server.stop()
    before, after = runs["file_stream"], runs["core_nats"]
    return {
        "tokens": cfg.tokens,
        "nats": "nats-server, JetStream, sync_interval: always (the stack's flags), one node",
        "runs": runs,
        "before": "file_stream", "after": "core_nats",
        "disk_write_bytes_per_token_before_after": [before["disk_write_bytes_per_token"],
                                                    after["disk_write_bytes_per_token"]],
        "stored_bytes_per_token_before_after": [before["stored_bytes_per_token"], after["stored_bytes_per_token"]],
    }
