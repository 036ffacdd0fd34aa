"""`kvmesh bench fleet`: the control plane at 100 and 1,000 emulated workers, on a real nats-server.

Per fleet size N, on a fresh nats-server (JetStream, as the stack runs it):
- the services under test run in processes of their own (bench/fleet_procs.py):
  a cache-index replica, the eviction service, the routing half of an ingress;
- N emulated workers (bench/fleet_worker.py) beat into the `workers` bucket,
  publish KV events with the real publisher and consume their eviction
  commands through their durable consumers;
- the trace (a Mooncake JSONL prefix) is replayed at `speed` x: the ingress
  looks each request up in the index over NATS, the router picks the worker,
  that worker stores the chain (its LRU L1 reports what left); the ingress
  also probes at `lookup_rate`.
Each size runs in a process of its own, which lowers its priority
(`emulator_nice`) once the services and nats-server are up: the emulated
fleet stands for N other machines, and on a 2-core box it would otherwise
take the cores the services under test answer on (measured: the index and
ingress event loops both stalled 25-50 ms at once while it ran the replay's
stores). Measured: lookup p99 over NATS and where it goes (`lookup_legs`: to the
index's handler, in it, back), routing decision p50/p99, the index's lag
behind KV_EVENTS during the replay and its ingest rate (a fresh replica
reading the stream: events/s) against 10 x the trace's event rate,
eviction advice latency (a worker's L1 pushed over the high watermark ->
the Demote reaching its consumer), NATS resources (/jsz, /varz), index RSS
per 1M blocks, and the per-worker consumers left after 200 worker ids start
and stop. One row per N; `growth` divides the last row by the first.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
import traceback
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bench.fleet_procs import (
    ASSIGN,
    STATS,
    eviction_main,
    index_main,
    ingress_main,
)
from kvmesh.bench.fleet_worker import EmulatedWorker, FleetWorkerConfig
from kvmesh.bus.connection import close, connect
from kvmesh.bus.publish import Publisher
from kvmesh.cache_index.service import CacheIndex
from kvmesh.config import BusSettings, EvictionSettings, IndexSettings
from kvmesh.log import configure_logging
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.streams import KV_EVENTS, declare_all
from kvmesh.stack.servers import NatsServer
from rich.console import Console
from rich.progress import Progress

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "mooncake_synthetic_trace.jsonl"
CHURN_PREFIX = "churn-"


@dataclass(slots=True)
class FleetBenchConfig:
    workers: tuple[int, ...] = (100, 1000)
    trace: Path = DEFAULT_TRACE
    requests: int = 400  # trace prefix replayed per fleet size
    speed: float = 10.0  # replay at this multiple of the trace's timestamps
    lookup_rate: float = 50.0  # extra lookup + routing probes per second
    l1_blocks: int = 256  # each emulated worker's L1 (and the eviction service's capacity)
    tick_s: float = EvictionSettings().tick_s
    advice_probes: int = 12  # workers pushed over the watermark, one after another
    churn: int = 200  # worker ids started and stopped
    churn_wait_s: float = 10.0  # how long consumers of stopped workers may take to go
    heartbeat_s: float = FleetWorkerConfig(0).heartbeat_interval_s  # the services' default interval
    worker_fetch_timeout_s: float = FleetWorkerConfig(0).worker_fetch_timeout_s  # the workers' default idle poll
    seed: int = 0
    # The emulated workers stand for N machines, not for CPU the services under test would share: once
    # the index, eviction, ingress and nats-server are up at nice 0, the emulating process runs at this
    # nice, so on a 2-core box it takes what they leave (0: compete as equals).
    emulator_nice: int = 10


Trace = list[tuple[float, int, list[bytes]]]  # (seconds, input tokens, block hashes)


def load_trace(path: Path, requests: int) -> Trace:
    """The first `requests` lines; each hash id becomes a fixed 32-byte block hash (equal ids, equal hashes)."""
    out: Trace = []
    with open(path) as f:
        for line in f:
            if len(out) >= requests:
                break
            r = json.loads(line)
            chain = [hashlib.sha256(b"mooncake/%d" % i).digest() for i in r["hash_ids"]]
            out.append((r["timestamp"] / 1000.0, int(r["input_length"]), chain))
    return out


def _pct(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "n": 0}
    s = sorted(samples)
    return {"p50_ms": round(s[len(s) // 2] * 1e3, 3), "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3, 3),
            "n": len(s)}


def lookup_legs(round_trips: list[list[float]], spans: list[list[float]]) -> dict[str, dict[str, float]]:
    """Where a lookup's time goes: to the index's handler, in it, and back to the asker.

    Both processes stamp the machine's monotonic clock; a round trip is matched to the one handler
    span that lies inside it (round trips overlapped by another's span are left out).
    """
    spans = sorted(spans)
    starts = [s for s, _ in spans]
    legs: dict[str, list[float]] = {"to_index": [], "in_index": [], "back": []}
    for sent, answered in round_trips:
        i = bisect.bisect_left(starts, sent)
        inside = [(s, e) for s, e in spans[i:i + 3] if e <= answered]
        if len(inside) == 1:
            (s, e), = inside
            legs["to_index"].append(s - sent)
            legs["in_index"].append(e - s)
            legs["back"].append(answered - e)
    return {k: _pct(v) for k, v in legs.items()}


def _monitor(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


def nats_resources(port: int) -> dict:
    """Streams, consumers (by name), Raft groups and server totals from the monitoring endpoint."""
    jsz = _monitor(port, "/jsz?consumers=true&raft=true")
    varz = _monitor(port, "/varz")
    names = [c["name"] for a in jsz.get("account_details", []) for s in a.get("stream_detail", [])
             for c in s.get("consumer_detail", [])]
    raft = sum(1 for a in jsz.get("account_details", []) for s in a.get("stream_detail", [])
               if s.get("raft_group")) + (1 if jsz.get("meta_cluster") else 0)
    return {"streams": jsz.get("streams", 0), "consumers": jsz.get("consumers", 0), "consumer_names": names,
            "raft_groups": raft, "server_mem_mb": round(varz.get("mem", 0) / 2**20, 1),
            "server_cpu_pct": varz.get("cpu", 0), "subscriptions": varz.get("subscriptions", 0),
            "in_msgs": varz.get("in_msgs", 0)}


class _Run:
    """One fleet size against its own nats-server."""

    def __init__(self, cfg: FleetBenchConfig, n: int, trace: Trace, server: NatsServer, progress: Progress) -> None:
        self.cfg, self.n, self.trace, self.server, self.progress = cfg, n, trace, server, progress
        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.workers: dict[str, EmulatedWorker] = {}
        self.events = 0

    def _spawn(self, target, *args) -> mp.Queue:
        q = self.ctx.Queue()
        p = self.ctx.Process(target=target, args=(*args, q), daemon=True)
        p.start()
        self.procs.append(p)
        return q

    async def _got(self, q: mp.Queue, timeout_s: float = 600.0):
        return await asyncio.to_thread(q.get, True, timeout_s)

    async def run(self) -> dict:
        cfg, url = self.cfg, self.server.url
        self.nc = await connect(url, "fleet-bench", BusSettings())
        self.js = self.nc.jetstream()
        await declare_all(self.js)
        publisher, metrics = Publisher(self.js, BusSettings()), ServiceMetrics.create("fleet-bench")
        qi = self._spawn(index_main, url)
        qe = self._spawn(eviction_main, url, cfg.l1_blocks, cfg.tick_s)
        await self._got(qi), await self._got(qe)
        index_rss_empty = (await self._index_stats())["rss"]
        sub = await self.nc.subscribe(ASSIGN, cb=self._on_assign)
        qg = self._spawn(ingress_main, url, self.n, self.trace, cfg.speed, cfg.lookup_rate, cfg.seed)
        # The services under test (and nats-server) are up at nice 0; from here this process is the fleet.
        os.nice(cfg.emulator_nice)
        wcfg = self.wcfg = FleetWorkerConfig(cfg.l1_blocks, heartbeat_interval_s=cfg.heartbeat_s,
                                             heartbeat_ttl_s=max(5.0, 5 * cfg.heartbeat_s),
                                             worker_fetch_timeout_s=cfg.worker_fetch_timeout_s)
        task = self.progress.add_task(f"N={self.n}: workers up", total=self.n)
        for start in range(0, self.n, 50):
            batch = [EmulatedWorker(f"w{i}", self.nc, self.js, publisher, metrics, wcfg)
                     for i in range(start, min(self.n, start + 50))]
            await asyncio.gather(*(w.start() for w in batch))
            self.workers.update((w.worker_id, w) for w in batch)
            self.progress.update(task, completed=len(self.workers))
        await self._got(qg)  # the ingress has seen every worker live and starts the replay
        beats, t0 = self._beats(), time.perf_counter()
        lag = await self._sample_lag(qg)
        beat_rate = (self._beats() - beats) / (time.perf_counter() - t0) / self.n
        ingress = lag.pop("ingress")
        await sub.unsubscribe()
        await asyncio.gather(*(w.events.flushed(60.0) for w in self.workers.values()))
        drain_s = await self._caught_up()
        replay_events = self.events  # before the advice probes add their fillers
        stats = await self._index_stats(b"nbytes")
        advice = await self._advice_latency()
        resources = nats_resources(self.server.monitor_port)
        churn = await self._churn(publisher, metrics)
        for p in self.procs:
            p.terminate()
        await asyncio.gather(*(w.stop(withdraw=False) for w in self.workers.values()))
        ingest = await self._ingest_rate()
        await close(self.nc)
        trace_s = self.trace[-1][0] - self.trace[0][0] or 1.0
        trace_rate = replay_events / trace_s  # KV events per second of trace time, at 1x
        blocks = max(stats["blocks"], 1)
        names = resources.pop("consumer_names")
        return {
            "workers": self.n,
            "lookup_p99_ms": _pct(ingress["lookups"])["p99_ms"],
            "lookup_nats": _pct(ingress["lookups"]),
            "lookup_in_index_cpu": _pct(stats["handled"]),
            "lookup_legs": lookup_legs(ingress["round_trips"], stats["spans"]),
            "lookup_failures": ingress["lookup_failures"],
            "routing_decision": _pct(ingress["decisions"]),
            "heartbeat_writes_per_worker_s": round(beat_rate, 3),  # during the replay
            "heartbeat_write_failures": int(metrics.registry.get_sample_value("kvmesh_heartbeat_failures_total") or 0),
            "probe_lookups_per_s": round(ingress["probe_rate"], 1),
            "index_ingest_events_per_s": ingest["events_per_s"],
            "trace_events_per_s_1x": round(trace_rate, 1),
            "ingest_over_10x_trace": round(ingest["events_per_s"] / (10 * trace_rate), 1) if trace_rate else None,
            "ingest_keeps_up_10x": ingest["events_per_s"] >= 10 * trace_rate and drain_s is not None,
            "replay_lag": {**lag, "drain_after_replay_s": drain_s},
            "eviction_advice": advice,
            "nats": {**resources, "per_worker_consumers": sum(1 for c in names if c.startswith("cmd-w")),
                     "consumers_refused": sum(1 for w in self.workers.values() if w.consumer_error),
                     "refusal": next((w.consumer_error for w in self.workers.values() if w.consumer_error), None),
                     "raft_groups_if_r3_cluster": resources["streams"] + resources["consumers"] + 1},
            "index_blocks": stats["blocks"],
            "index_rss_mb": round(stats["rss"] / 2**20, 1),
            "index_rss_growth_mb": round((stats["rss"] - index_rss_empty) / 2**20, 1),
            "index_mb_per_1m_blocks": round(stats["nbytes"] / blocks * 1e6 / 2**20, 1),
            "consumers_left_after_churn": churn["left"],
            "churn": churn,
        }

    def _beats(self) -> int:
        """Heartbeats the emulated workers have written so far (each one's `seq` counts its writes)."""
        return sum(w.heartbeat.seq for w in self.workers.values())

    async def _on_assign(self, msg) -> None:
        a = json.loads(msg.data)
        w = self.workers.get(a["w"])
        if w is not None:
            self.events += w.store(self.trace[a["i"]][2])

    async def _index_stats(self, ask: bytes = b"") -> dict:
        return json.loads((await self.nc.request(STATS, ask, timeout=30)).data)

    async def _stream_last(self) -> int:
        return (await self.js.stream_info(KV_EVENTS.name)).state.last_seq

    async def _sample_lag(self, qg: mp.Queue) -> dict:
        """Stream messages the index has not applied yet, sampled every 0.25 s until the ingress is done."""
        task = self.progress.add_task(f"N={self.n}: replay x{self.cfg.speed:g}", total=None)
        done = asyncio.ensure_future(self._got(qg))
        behind: list[int] = []
        while not done.done():
            last, applied = await self._stream_last(), (await self._index_stats())["stream_seq"]
            behind.append(max(0, last - applied))
            self.progress.update(task, description=f"N={self.n}: replay x{self.cfg.speed:g}, {self.events} events")
            await asyncio.wait({done}, timeout=0.25)
        self.progress.remove_task(task)
        s = sorted(behind) or [0]
        return {"ingress": done.result(), "behind_msgs_p50": s[len(s) // 2], "behind_msgs_max": s[-1]}

    async def _caught_up(self, limit_s: float = 120.0) -> float | None:
        """Seconds until the index has applied everything in the stream now (None: not within `limit_s`)."""
        target, t0 = await self._stream_last(), time.perf_counter()
        while (await self._index_stats())["stream_seq"] < target:
            if time.perf_counter() - t0 > limit_s:
                return None
            await asyncio.sleep(0.02)
        return round(time.perf_counter() - t0, 3)

    async def _advice_latency(self) -> dict:
        """Push one worker at a time over the high watermark; time until its Demote arrives (and is published)."""
        high = EvictionSettings().high_water
        samples, decided, missed = [], [], 0
        on_bus: dict[str, float] = {}

        async def seen(msg) -> None:  # the command as the eviction service publishes it
            on_bus.setdefault(msg.subject, time.perf_counter())
        sub = await self.nc.subscribe(subjects.COMMANDS_ALL, cb=seen)
        # The emptiest workers: one the replay filled may sit in its re-advise window (advice it already had).
        ids = sorted(self.workers, key=lambda w: len(self.workers[w].l1))[: self.cfg.advice_probes]
        task = self.progress.add_task(f"N={self.n}: eviction advice", total=len(ids))
        rng = random.Random(self.cfg.seed)
        for k, wid in enumerate(ids):
            # A random phase against the service's tick: probing right after the last advice would wait
            # a whole tick every time.
            await asyncio.sleep(rng.uniform(0, self.cfg.tick_s))
            w = self.workers[wid]
            fill = int(high * self.cfg.l1_blocks) + 2 - len(w.l1)
            filler = [hashlib.sha256(b"fill/%d/%d/%d" % (self.n, k, j)).digest() for j in range(max(fill, 1))]
            w.advised.clear()
            on_bus.clear()
            t0 = time.perf_counter()
            self.events += w.store(filler)
            try:
                await asyncio.wait_for(w.advised.wait(), 10 * self.cfg.tick_s + 10.0)
                samples.append(w.advised_at - t0)
                decided.append(on_bus.get(subjects.commands(wid), w.advised_at) - t0)
            except TimeoutError:
                missed += 1
            self.progress.advance(task)
        await sub.unsubscribe()
        return {**_pct(samples), "missed": missed, "tick_s": self.cfg.tick_s, "published": _pct(decided)}

    async def _churn(self, publisher: Publisher, metrics: ServiceMetrics) -> dict:
        """Start and stop `churn` worker ids (heartbeat, events, command consumer); count their consumers left."""
        wcfg = self.wcfg
        task = self.progress.add_task(f"N={self.n}: churn", total=self.cfg.churn)
        refused = 0
        for start in range(0, self.cfg.churn, 25):
            batch = [EmulatedWorker(f"{CHURN_PREFIX}{i}", self.nc, self.js, publisher, metrics, wcfg)
                     for i in range(start, min(self.cfg.churn, start + 25))]
            await asyncio.gather(*(w.start() for w in batch))
            refused += sum(1 for w in batch if w.consumer_error)
            await asyncio.gather(*(w.stop() for w in batch))
            self.progress.advance(task, len(batch))
        t0 = time.perf_counter()
        while True:
            left = sum(1 for c in nats_resources(self.server.monitor_port)["consumer_names"] if CHURN_PREFIX in c)
            if not left or time.perf_counter() - t0 > self.cfg.churn_wait_s:
                return {"left": left, "started": self.cfg.churn, "consumers_refused": refused,
                        "waited_s": round(time.perf_counter() - t0, 2)}
            await asyncio.sleep(0.5)

    async def _ingest_rate(self) -> dict:
        """A fresh replica reads the whole KV_EVENTS stream with nothing else running: events applied per second."""
        replica = CacheIndex(self.nc, self.js, IndexSettings(snapshot_name="fleet-bench-replay"), watch=False)
        await replica.start()
        while not replica.ready:
            await asyncio.sleep(0.005)
        secs = max(replica.ready_after_s or 0.0, 1e-6)
        applied = replica.state.events_applied
        await replica.stop(write_snapshot=False)
        return {"events_per_s": round(applied / secs), "events": applied}


def run_fleet_bench(cfg: FleetBenchConfig) -> dict:
    configure_logging("warning")  # logs to stderr, never into the JSON on stdout
    # SIGTERM (a timeout) unwinds like Ctrl-C, so the nats-server and the service processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    trace = load_trace(cfg.trace, cfg.requests)
    rows = []
    ctx = mp.get_context("spawn")
    for n in cfg.workers:  # each size in a process of its own: it lowers its priority once its services are up
        q = ctx.Queue()
        size = ctx.Process(target=_size_main, args=(cfg, n, trace, q))
        size.start()
        try:
            row = q.get(timeout=3600)
            size.join(timeout=120)  # it stops its nats-server and service processes itself
        finally:
            if size.is_alive():
                size.terminate()
            size.join()
        if isinstance(row, str):
            raise RuntimeError(f"fleet size {n} failed:\n{row}")
        rows.append(row)
    return {"rows": rows, "growth": _growth(rows) if len(rows) > 1 else {},
            "config": {"trace": cfg.trace.name, "requests": len(trace), "trace_s": round(trace[-1][0], 1),
                       "blocks_in_trace": sum(len(c) for _, _, c in trace), "speed": cfg.speed,
                       "lookup_rate": cfg.lookup_rate, "l1_blocks": cfg.l1_blocks, "churn": cfg.churn,
                       "heartbeat_interval_s": cfg.heartbeat_s, "worker_fetch_timeout_s": cfg.worker_fetch_timeout_s,
                       "emulator_nice": cfg.emulator_nice, "cpus": os.cpu_count(),
                       "load_avg_1m": round(os.getloadavg()[0], 1)}}


def _size_main(cfg: FleetBenchConfig, n: int, trace: Trace, out: mp.Queue) -> None:
    """One fleet size on its own nats-server; puts its row (or the traceback) on `out`."""
    configure_logging("warning")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with Progress(console=Console(stderr=True), transient=True) as progress, \
            tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(data_dir=Path(tmp) / "nats")
        server.start()
        run = None
        try:
            run = _Run(cfg, n, trace, server, progress)
            out.put(asyncio.run(run.run()))
        except Exception:  # noqa: BLE001 - the parent raises it with the traceback
            out.put(traceback.format_exc())
        finally:
            for p in run.procs if run is not None else ():
                p.terminate()
            server.stop()


def _growth(rows: list[dict]) -> dict:
    """Last row over first, for each cost (how it grows with the fleet)."""
    a, b = rows[0], rows[-1]

    def ratio(x: float, y: float) -> float | None:
        return round(y / x, 2) if x else None
    return {
        "workers": ratio(a["workers"], b["workers"]),
        "lookup_p99_ms": ratio(a["lookup_p99_ms"], b["lookup_p99_ms"]),
        "routing_decision_p99_ms": ratio(a["routing_decision"]["p99_ms"], b["routing_decision"]["p99_ms"]),
        "eviction_advice_p50_ms": ratio(a["eviction_advice"]["p50_ms"], b["eviction_advice"]["p50_ms"]),
        "index_ingest_events_per_s": ratio(a["index_ingest_events_per_s"], b["index_ingest_events_per_s"]),
        "consumers": ratio(a["nats"]["consumers"], b["nats"]["consumers"]),
        "nats_server_mem_mb": ratio(a["nats"]["server_mem_mb"], b["nats"]["server_mem_mb"]),
        "index_mb_per_1m_blocks": ratio(a["index_mb_per_1m_blocks"], b["index_mb_per_1m_blocks"]),
    }
