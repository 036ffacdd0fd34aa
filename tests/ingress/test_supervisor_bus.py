"""The supervisor against a real JetStream, with a scripted peer speaking the serving protocol.

The peer plays prefill and decode workers so the test can produce what real
workers rarely do on cue: a lost token event (a gap), an error event. The
ingress side is the real Gateway; workers are fed to its table directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import nats
import pytest
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import serve
from kvmesh.cache_index.messages import LookupReply, LookupRequest
from kvmesh.config import BusSettings, IngressSettings
from kvmesh.ingress.core.errors import ErrorKind
from kvmesh.ingress.core.types import GatewayError, GenerationRequest
from kvmesh.ingress.routing.prefix_locator import PrefixLocator
from kvmesh.ingress.routing.workers import WorkerTable
from kvmesh.ingress.supervision.gateway import Gateway
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import Heartbeat, Role
from kvmesh.protocol.serving import (
    AbortRequest,
    DecodeJob,
    PrefillJob,
    SamplingSpec,
    TokenEvent,
)
from kvmesh.protocol.streams import declare_all
from kvmesh.service.watch import Change, WorkerChange
from prometheus_client import CollectorRegistry


def _up(table: WorkerTable, worker: str, role: Role) -> None:
    hb = Heartbeat(worker_id=worker, role=role, load=0.0, capacity=4.0, started_at=datetime.now(UTC),
                   http_endpoint="http://127.0.0.1:1", seq=0, ttl_s=5.0)
    table.apply(WorkerChange(Change.UP, worker, hb))


@pytest.fixture
async def gateway(nats_server) -> AsyncIterator[Gateway]:  # type: ignore[no-untyped-def]
    nc = await nats.connect(nats_server.url)
    await declare_all(nc.jetstream())
    table = WorkerTable()
    for worker, role in (("sv-p0", Role.PREFILL), ("sv-d0", Role.DECODE), ("sv-d1", Role.DECODE)):
        _up(table, worker, role)
    settings = IngressSettings(first_token_timeout_s=2.0, inter_token_timeout_s=1.0, max_attempts=3)
    yield Gateway(nc, Publisher(nc.jetstream(), BusSettings()), table, settings, lambda ids: ",".join(map(str, ids)))
    await nc.close()


def _spawning(handler):  # type: ignore[no-untyped-def]
    """A subscription callback that runs each message's handler as its own task (a peer handles jobs concurrently)."""
    tasks: set[asyncio.Task[None]] = set()

    async def cb(msg) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(handler(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return cb


def _request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, "t", "00", [1, 2, 3], SamplingSpec(max_tokens=7))


def _event(rid: str, seq: int, ids: list[int], attempt: int = 0, **kw: object) -> bytes:
    return TokenEvent(request_id=rid, attempt=attempt, seq=seq, token_ids=ids, text=",".join(map(str, ids)),
                      prompt_tokens=3, **kw).to_bytes()


async def test_a_gap_that_never_fills_migrates_despite_later_events(gateway: Gateway) -> None:
    rid = f"gap-{time.monotonic_ns()}"
    nc = gateway.nc
    migrations: list[DecodeJob] = []

    async def on_job(msg) -> None:  # type: ignore[no-untyped-def]
        if msg.subject.startswith("kvmesh.jobs.prefill."):
            job = PrefillJob.from_bytes(msg.data)
            if job.request_id != rid:
                return
            await nc.publish(subjects.tokens(rid), _event(rid, 0, [10]))
            await nc.publish(subjects.tokens(rid), _event(rid, 1, [11]))
            for seq in range(3, 28):  # seq 2 is "lost"; later events keep coming for 5 s
                await nc.publish(subjects.tokens(rid), _event(rid, seq, [10 + seq]))
                await asyncio.sleep(0.2)
        else:
            job = DecodeJob.from_bytes(msg.data)
            migrations.append(job)
            rest = list(range(10 + len(job.generated), 17))
            await nc.publish(subjects.tokens(rid), _event(rid, len(job.generated), rest, attempt=job.attempt,
                                                          finished=True, finish_reason="length"))

    sub = await nc.subscribe(subjects.JOBS_ALL, cb=_spawning(on_job))
    started = time.monotonic()
    try:
        done = await gateway.complete(_request(rid))
    finally:
        await sub.unsubscribe()
    assert done.token_ids == list(range(10, 17)) and done.finish_reason == "length"
    assert [(j.generated, j.attempt) for j in migrations] == [([10, 11], 1)]
    assert time.monotonic() - started < 4.0  # migrated ~1 s after the last progress, not after the stream ended
    assert done.usage.attempts == 2 and done.usage.decode_worker in ("sv-d0", "sv-d1")


async def test_error_events_retry_or_fail(gateway: Gateway) -> None:
    nc = gateway.nc
    rid = f"err-{time.monotonic_ns()}"
    attempts: list[int] = []

    async def on_job(msg) -> None:  # type: ignore[no-untyped-def]
        job = PrefillJob.from_bytes(msg.data)  # only prefill jobs: no token is ever handed to decode here
        if job.request_id == rid:
            attempts.append(job.attempt)
            if job.attempt == 0:  # a retriable failure, then success on the retry
                await nc.publish(subjects.tokens(rid), _event(rid, 0, [], error="tier hiccup", finished=True,
                                                              finish_reason="error"))
            else:
                await nc.publish(subjects.tokens(rid), _event(rid, 0, [5], attempt=job.attempt, finished=True,
                                                              finish_reason="stop"))
        elif job.request_id == rid + "-bad":
            await nc.publish(subjects.tokens(job.request_id), _event(job.request_id, 0, [], error="prompt too long",
                                                                     retriable=False, finished=True))

    sub = await nc.subscribe(subjects.JOBS_ALL, cb=_spawning(on_job))
    try:
        done = await gateway.complete(_request(rid))
        assert done.token_ids == [5] and attempts == [0, 1]
        with pytest.raises(GatewayError) as err:
            await gateway.complete(_request(rid + "-bad"))
        assert err.value.kind is ErrorKind.INVALID_REQUEST and not err.value.retriable
    finally:
        await sub.unsubscribe()


async def test_too_many_in_flight_is_overload(gateway: Gateway) -> None:
    gateway.settings.max_in_flight = 1
    rid = f"busy-{time.monotonic_ns()}"
    first = asyncio.create_task(gateway.complete(_request(rid)))  # nobody answers: it stays in flight
    for _ in range(100):
        if gateway.in_flight:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(GatewayError) as err:
        await gateway.complete(_request(rid + "-2"))
    assert err.value.kind is ErrorKind.OVERLOADED
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert gateway.in_flight == 0


async def test_a_resumed_zombie_is_fenced_and_its_worker_told_to_stop(gateway: Gateway) -> None:
    """Decode goes silent after two tokens; the ingress migrates. The old attempt then "resumes" and sends a
    different continuation (and a final event) before the new attempt answers: none of it reaches the
    client, each of its events is counted, and the replaced worker gets an abort naming attempt 0 only."""
    rid = f"zombie-{time.monotonic_ns()}"
    nc = gateway.nc
    jobs: list[PrefillJob | DecodeJob] = []
    aborts: list[tuple[str, AbortRequest]] = []
    aborted = asyncio.Event()
    stale: list[int] = []
    gateway.on_stale_event = lambda: stale.append(1)

    async def on_job(msg) -> None:  # type: ignore[no-untyped-def]
        if msg.subject.startswith("kvmesh.jobs.prefill."):
            job = PrefillJob.from_bytes(msg.data)
            if job.request_id == rid:
                jobs.append(job)
                await nc.publish(subjects.tokens(rid), _event(rid, 0, [10]))
                await nc.publish(subjects.tokens(rid), _event(rid, 1, [11]))  # then silence: the worker is paused
            return
        job = DecodeJob.from_bytes(msg.data)
        if job.request_id != rid:
            return
        jobs.append(job)
        # the zombie first: in seq order and ahead of the new attempt, as a splice would need
        await nc.publish(subjects.tokens(rid), _event(rid, 2, [90, 91]))
        await nc.publish(subjects.tokens(rid), _event(rid, 4, [92, 93, 94], finished=True, finish_reason="length"))
        await nc.publish(subjects.tokens(rid), _event(rid, 2, [12, 13, 14, 15, 16], attempt=job.attempt,
                                                      finished=True, finish_reason="length"))

    async def on_abort(msg) -> None:  # type: ignore[no-untyped-def]
        aborts.append((msg.subject, AbortRequest.from_bytes(msg.data)))
        aborted.set()

    subs = [await nc.subscribe(subjects.JOBS_ALL, cb=_spawning(on_job)),
            await nc.subscribe(subjects.ABORT_ALL, cb=on_abort)]
    try:
        req = GenerationRequest(rid, "t", "00", [1, 2, 3], SamplingSpec(max_tokens=7, temperature=0.8))
        done = await gateway.complete(req)
        await asyncio.wait_for(aborted.wait(), 10)
    finally:
        for sub in subs:
            await sub.unsubscribe()
    assert done.token_ids == list(range(10, 17)) and done.finish_reason == "length"
    assert len(stale) == 2  # both zombie events, the early final included
    prefill, migration = jobs
    assert isinstance(migration, DecodeJob) and migration.attempt == 1 and migration.generated == [10, 11]
    replaced = prefill.decode_worker
    assert aborts == [(subjects.abort(replaced), AbortRequest(request_id=rid, attempt=0, reason="migrated"))]
    # an unseeded sampled request got one seed at the ingress, and the migrated attempt carries the same one
    assert prefill.sampling.seed is not None and migration.sampling.seed == prefill.sampling.seed


async def test_the_job_carries_the_index_answer_and_dispatch_is_told_once(nats_server) -> None:  # type: ignore[no-untyped-def]
    """Routing asks the cache index once; each attempt's PrefillJob carries its L3 answer (the worker does not
    ask again), and `on_dispatched` runs once, after the first job is on the bus, not again for the retry."""
    nc = await nats.connect(nats_server.url)
    await declare_all(nc.jetstream())
    table = WorkerTable()
    for worker, role in (("ix-p0", Role.PREFILL), ("ix-p1", Role.PREFILL), ("ix-d0", Role.DECODE)):
        _up(table, worker, role)

    async def lookup(req: LookupRequest) -> LookupReply:
        return LookupReply(workers=[], l3_blocks=len(req.hashes) - 1, indexed_blocks=9, ready=True)

    responder = await serve(nc, subjects.INDEX_LOOKUP, LookupRequest, lookup, queue="cache-index")
    locator = PrefixLocator.create(nc, "fp", 2, 1.0, CollectorRegistry())
    gateway = Gateway(nc, Publisher(nc.jetstream(), BusSettings()), table, IngressSettings(), str, locator=locator)
    rid = f"ix-{time.monotonic_ns()}"
    jobs: list[PrefillJob] = []
    dispatched: list[int] = []

    async def on_job(msg) -> None:  # type: ignore[no-untyped-def]
        job = PrefillJob.from_bytes(msg.data)
        if job.request_id != rid:
            return
        jobs.append(job)
        if job.attempt == 0:  # a retriable failure: the retry is routed (and told the answer) again
            await nc.publish(subjects.tokens(rid), _event(rid, 0, [], error="hiccup", finished=True,
                                                          finish_reason="error"))
        else:
            await nc.publish(subjects.tokens(rid), _event(rid, 0, [5], attempt=job.attempt, finished=True,
                                                          finish_reason="stop"))

    sub = await nc.subscribe(subjects.JOBS_ALL, cb=_spawning(on_job))
    try:
        req = GenerationRequest(rid, "t", "00", [1, 2, 3, 4, 5, 6, 7], SamplingSpec(max_tokens=1),
                                on_dispatched=lambda: dispatched.append(len(jobs)))
        done = await gateway.complete(req)
    finally:
        await sub.unsubscribe()
        await responder.drain()
        await nc.close()
    assert done.token_ids == [5]
    assert [(j.attempt, j.l3_blocks) for j in jobs] == [(0, 2), (1, 2)]  # 3 full blocks, the index says 2 in L3
    assert len(dispatched) == 1
