"""The `setup` of the prefill and decode services: a runtime, a worker, its consumers.

Each worker takes jobs from its own durable consumers (jobs addressed to it)
and from its role's shared queue (`any`); all settings come from the
environment (shared/config.py), the model from `KVMESH_MODEL_DIR`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvmesh.bus.consumer import typed
from kvmesh.eviction.messages import Retain
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.messages import Role
from kvmesh.protocol.serving import AbortRequest, DecodeJob, PrefillJob
from kvmesh.protocol.streams import (
    DECODE_ANY,
    HANDOFF,
    HANDOFF_ANY,
    JOBS,
    PREFILL_ANY,
    ConsumerSpec,
    worker_consumer,
)
from kvmesh.service.runner import ServiceContext
from kvmesh.serving.audit import CacheAudit
from kvmesh.serving.decode_worker import DecodeWorker
from kvmesh.serving.pinning import L2Pins
from kvmesh.serving.prefill_worker import PrefillWorker
from kvmesh.serving.runtime import WorkerRuntime, job_consumer
from kvmesh.serving.tier_metrics import CommandsCollector
from kvmesh.serving.worker_commands import CommandHandler, command_consumer

log = get_logger(__name__)


def own_job_consumers(role: Role, worker_id: str) -> tuple[ConsumerSpec, ...]:
    """The per-worker consumers of the work addressed to `worker_id` (besides its commands, `command_consumer`).

    They expire when idle and are deleted at drain (`ConsumerSpec.per_worker`); the shared `any` queues stay.
    """
    if role is Role.PREFILL:
        return (worker_consumer(JOBS, "prefill", worker_id, subjects.jobs_prefill(worker_id)),)
    if role is Role.DECODE:
        return (worker_consumer(HANDOFF, "handoff", worker_id, subjects.handoff(worker_id)),
                worker_consumer(JOBS, "decode", worker_id, subjects.jobs_decode(worker_id)))
    raise ValueError(f"{role} workers take no jobs")


async def listen_for_aborts(ctx: ServiceContext, abort: Callable[[AbortRequest], None]) -> None:
    """AbortRequests to this worker (core NATS, best effort) stop the named request (or attempt)."""

    async def on_abort(msg) -> None:
        try:
            abort(AbortRequest.from_bytes(msg.data))
        except ProtocolError as exc:
            log.warning("unreadable abort ignored", error=str(exc))

    sub = await ctx.nc.subscribe(subjects.abort(ctx.worker_id), cb=on_abort)
    ctx.on_stop.insert(0, sub.unsubscribe)


def obey_eviction(ctx: ServiceContext, rt: WorkerRuntime) -> CommandHandler:
    """The eviction service's advice (demote / drop / warm) for this worker, applied to its engine and tiers.

    Advice only: the engine never waits for it and refuses to move pinned or in-use blocks.
    """
    commands = CommandHandler(rt.engine, rt.tiers.l2, rt.tiers.l3, rt.events, peers=rt.tiers.resolver.peers)
    ctx.metrics.registry.register(CommandsCollector(lambda: commands.applied))
    ctx.add_consumer(command_consumer(ctx.worker_id), commands.on_message)
    return commands


async def take_pulls(ctx: ServiceContext, commands: CommandHandler) -> None:
    """Pulls to this decode worker (core NATS, from a prefill worker streaming a prompt it will hand
    off here: shared/serving/prefill_stream.py) are applied as prefetches, one at a time, in order."""
    order = asyncio.Lock()

    async def apply(cmd: Retain, pull_id: str) -> None:
        async with order:
            try:
                got = await commands.retain(cmd)
            except Exception as exc:  # noqa: BLE001 - advice: the DecodeJob fetches what this did not
                log.warning("pull failed", pull=pull_id, error=repr(exc))
                return
        log.info("pulled", pull=pull_id, owner=cmd.owner, blocks=len(cmd.hashes), fetched=got.prefetched,
                 held=got.retained)

    async def on_pull(msg) -> None:
        try:
            cmd = Retain.from_bytes(msg.data)
        except ProtocolError as exc:
            log.warning("unreadable pull ignored", error=str(exc))
            return
        pull_id = (msg.headers or {}).get(subjects.HDR_MSG_ID, "")
        pending.add(task := asyncio.create_task(apply(cmd, pull_id)))
        task.add_done_callback(pending.discard)

    pending: set[asyncio.Task] = set()
    sub = await ctx.nc.subscribe(subjects.pull(ctx.worker_id), cb=on_pull)
    ctx.on_stop.insert(0, sub.unsubscribe)


async def setup_prefill(ctx: ServiceContext) -> None:
    rt = await WorkerRuntime.start(ctx)
    obey_eviction(ctx, rt)
    block_bytes = rt.loaded.config.kv_bytes_per_token() * ctx.settings.engine.block_size
    l2_pins = L2Pins.for_tier(ctx.settings.pins, rt.tiers.l2.capacity_bytes, block_bytes)
    worker = PrefillWorker(ctx.worker_id, rt, ctx.publisher, ctx.settings.workers, l2_pins=l2_pins)
    handler = typed(PrefillJob, worker.handle)
    # an attempt-scoped abort stops a request that decoded here and was migrated away
    await listen_for_aborts(ctx, lambda a: worker.abort(a.request_id, a.attempt))
    for spec in (*own_job_consumers(Role.PREFILL, ctx.worker_id), PREFILL_ANY):
        ctx.add_consumer(job_consumer(spec, ctx.settings.engine.max_num_seqs), handler)


async def setup_decode(ctx: ServiceContext) -> None:
    rt = await WorkerRuntime.start(ctx)
    await take_pulls(ctx, obey_eviction(ctx, rt))
    audit = CacheAudit(rt.engine, ctx.settings.audit_rate, ctx.metrics.registry)
    ctx.on_stop.insert(0, audit.close)
    worker = DecodeWorker(ctx.worker_id, rt, ctx.publisher, audit, ctx.settings.workers)
    handler = typed(DecodeJob, worker.handle)
    await listen_for_aborts(ctx, lambda a: worker.abort(a.request_id, a.attempt))
    for spec in (*own_job_consumers(Role.DECODE, ctx.worker_id), HANDOFF_ANY, DECODE_ANY):
        ctx.add_consumer(job_consumer(spec, ctx.settings.engine.max_num_seqs), handler)
