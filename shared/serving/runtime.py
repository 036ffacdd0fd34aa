"""What a prefill or decode worker process holds: the model on its engine thread, its tiers, its peers.

`WorkerRuntime.start(ctx)` loads `KVMESH_MODEL_DIR` (off the event loop),
starts the KV event publisher (the engine's listener; L2/L3 changes too),
the engine thread, the tiers (L2, L3 uploads, peer fetch server), the
peer directory and, with a session-aware eviction policy, the feed of
session turns into its book (shared/serving/session_feed.py), and wires readiness (engine thread alive), load
(live requests), capacity (`engine.max_num_seqs`) and its L1/L2 sizes in
blocks (heartbeat fields the eviction service advises by) into the service
context; everything is closed by the runner's stop hooks after the drain.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import torch

from kvmesh.background import HostIdle
from kvmesh.cache_policy.session import SessionAware
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.protocol.streams import ConsumerSpec
from kvmesh.service.runner import ServiceContext
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.peers import PeerDirectory
from kvmesh.serving.restore_gate import RestoreGate
from kvmesh.serving.session_feed import SessionFeed
from kvmesh.serving.tier_metrics import TierMetrics, export_worker_metrics
from kvmesh.serving.worker_tiers import WorkerTiers

# Jobs end by their own deadline (the ingress sets it); the consumer's hung-handler guard only backs it up.
_HANDLER_TIMEOUT_S = 3600.0


def job_consumer(spec: ConsumerSpec, max_handlers: int | None = None) -> ConsumerSpec:
    """`spec` for a worker's jobs: as many handlers at once as its engine runs sequences (`max_handlers`)."""
    return replace(spec, handler_timeout_s=_HANDLER_TIMEOUT_S, max_handlers=max_handlers)


@dataclass
class WorkerRuntime:
    loaded: LoadedModel
    engine: EngineLoop
    tiers: WorkerTiers
    peers: PeerDirectory
    events: KVEventPublisher  # L1 (engine), L2 and L3 changes -> the cache index
    sessions: SessionFeed | None = None  # with a session-aware engine policy: turns -> its book
    tier_metrics: TierMetrics | None = None  # hits / misses / bytes / restore time per tier on /metrics
    restore_gate: RestoreGate | None = None  # restore a tier only when it beats recompute here

    @classmethod
    async def start(cls, ctx: ServiceContext) -> WorkerRuntime:
        s = ctx.settings
        if s.model_dir is None:
            raise RuntimeError("KVMESH_MODEL_DIR is not set: a worker needs a checkpoint dir")
        if s.engine.threads:
            torch.set_num_threads(s.engine.threads)
        loaded = await asyncio.to_thread(load_model, s.model_dir, s.engine.dtype, s.engine.device)
        events = KVEventPublisher(ctx.publisher, ctx.worker_id, s.index)
        await events.start(ctx.nc)  # before the engine stores its first block
        engine = EngineLoop(Engine(loaded, s.engine, listener=events))  # policy: settings.engine.eviction_policy
        engine.start()
        block_bytes = loaded.config.kv_bytes_per_token() * s.engine.block_size
        tiers = await WorkerTiers.start(s, ctx.nc, ctx.worker_id, loaded.fingerprint, s.engine.block_size, events,
                                        block_bytes=block_bytes)
        if tiers.uploads is not None:  # uploads go between requests, on a quiet host (at most max_defer_s late)
            host = HostIdle()
            tiers.uploads.busy = lambda: engine.active > 0 or tiers.storing > 0 or host.busy()
        tiers.counters.export(ctx.metrics.registry)  # checksum/corruption misses visible on /metrics
        metrics = export_worker_metrics(ctx.metrics.registry, engine.engine, tiers, block_bytes)
        peers = PeerDirectory(ctx.js, ctx.worker_id)
        peers.start()
        policy = engine.engine.cache.policy
        sessions = SessionFeed(engine, policy) if isinstance(policy, SessionAware) else None
        if sessions is not None:
            await sessions.start(ctx.js)
        gate = RestoreGate.create(s.engine.block_size, ctx.metrics.registry) if s.workers.restore_gate else None
        rt = cls(loaded, engine, tiers, peers, events, sessions, metrics, gate)
        ctx.ready_check = lambda: engine.alive
        ctx.load = lambda: float(engine.active)
        ctx.capacity = float(s.engine.max_num_seqs)
        ctx.kv_position = events.position
        # The eviction service advises this worker at these sizes (its own settings are a fallback).
        ctx.l1_capacity_blocks = s.engine.num_blocks
        block_bytes = loaded.config.kv_bytes_per_token() * s.engine.block_size
        ctx.l2_capacity_blocks = tiers.l2.capacity_bytes // max(1, block_bytes)
        ctx.on_stop.append(rt.close)
        return rt

    async def close(self) -> None:
        if self.sessions is not None:
            await self.sessions.stop()
        await self.peers.stop()
        if self.tiers.uploads is not None:
            await self.tiers.uploads.join(timeout_s=5.0)  # what is queued goes out before the process ends
        await self.tiers.close()
        await asyncio.to_thread(self.engine.stop)
        await self.events.stop()
