"""The pull-consumer loop: redelivery after a crash, dead letters, in-progress, drain."""

from __future__ import annotations

import asyncio
import time

import structlog
from kvmesh.bus.connection import connect
from kvmesh.bus.consumer import ConsumerLoop, PermanentError, typed
from kvmesh.bus.publish import Publisher
from kvmesh.log import bind_request
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import ErrorReply
from kvmesh.protocol.streams import DEAD_LETTER, JOBS, ConsumerSpec
from nats.aio.msg import Msg

from .helpers import FAST_BUS, connected, eventually, unique


def _loop(nc, spec: ConsumerSpec, handler, metrics: ServiceMetrics | None = None, drain_s: float = 5.0):
    metrics = metrics or ServiceMetrics.create("test")
    js = nc.jetstream()
    return ConsumerLoop(js, spec, handler, Publisher(js, FAST_BUS, metrics), metrics, FAST_BUS, drain_s)


async def _crash_holding_the_next(url: str, spec: ConsumerSpec, publisher_nc, payload: bytes):
    """Instance A takes the message published next (`payload`) and dies without a verdict: its connection
    just closes, no ack, no nak. Returns the publish's ack and the delivery counts A saw."""
    nc_a = await connect(url, "instance-a", FAST_BUS)
    deliveries: list[int] = []
    a_has_it = asyncio.Event()

    async def hang(msg: Msg) -> None:
        deliveries.append(msg.metadata.num_delivered)
        a_has_it.set()
        await asyncio.Event().wait()

    loop_a = _loop(nc_a, spec, hang)
    task_a = asyncio.create_task(loop_a.run())
    await loop_a.wait_ready()
    ack = await Publisher(publisher_nc.jetstream(), FAST_BUS).publish(spec.filter_subject, payload, msg_id=unique())
    await asyncio.wait_for(a_has_it.wait(), 5)
    task_a.cancel()
    await nc_a.close()
    return ack, deliveries


async def _dead_letters(nc, stream: str, seq: int) -> Msg:
    """The dead letter of stream message `seq`, fetched by its header from the DLQ stream."""
    js = nc.jetstream()
    sub = await js.pull_subscribe(subjects.dead_letter(stream), stream=DEAD_LETTER.name)
    try:
        while True:
            for msg in await sub.fetch(10, timeout=2):
                await msg.ack()
                if msg.headers.get(subjects.HDR_DLQ_STREAM_SEQ) == str(seq):
                    return msg
    finally:
        await sub.unsubscribe()


async def _dead_letter_of_one(nc, spec: ConsumerSpec, handler) -> Msg:
    """Run a loop with `handler`, publish one message to it and wait for that message's dead letter; the loop
    is stopped after."""
    loop = _loop(nc, spec, handler)
    task = asyncio.create_task(loop.run())
    ack = await Publisher(nc.jetstream(), FAST_BUS).publish(spec.filter_subject, b"x", msg_id=unique())
    dead = await asyncio.wait_for(_dead_letters(nc, JOBS.name, ack.seq), 10)
    loop.stop()
    await asyncio.wait_for(task, 5)
    return dead


async def test_unacked_message_is_redelivered_to_another_instance(nats_server):
    worker = unique("w")
    spec = ConsumerSpec(JOBS.name, f"prefill-{worker}", subjects.jobs_prefill(worker), ack_wait_s=1.0)
    async with connected(nats_server.url) as nc_b:
        ack, a_deliveries = await _crash_holding_the_next(nats_server.url, spec, nc_b, b"job-1")
        got: list[tuple[str, int]] = [("a", n) for n in a_deliveries]

        async def take(msg: Msg) -> None:
            got.append(("b", msg.metadata.num_delivered))

        loop_b = _loop(nc_b, spec, take)
        task_b = asyncio.create_task(loop_b.run())
        await eventually(lambda: len(got) == 2, 10, "redelivery to instance B after ack_wait")
        loop_b.stop()
        await asyncio.wait_for(task_b, 5)
        assert got == [("a", 1), ("b", 2)]
        info = await nc_b.jetstream().consumer_info(JOBS.name, spec.durable)
        assert info.num_ack_pending == 0 and info.delivered.stream_seq == ack.seq


async def test_poison_message_is_dead_lettered_after_max_deliver(nats_server):
    worker = unique("w")
    spec = ConsumerSpec(JOBS.name, f"decode-{worker}", subjects.jobs_decode(worker), ack_wait_s=2.0, max_deliver=3)
    attempts: list[int] = []
    metrics = ServiceMetrics.create("test")

    async def always_fails(msg: Msg) -> None:
        attempts.append(msg.metadata.num_delivered)
        raise RuntimeError("model exploded")

    async with connected(nats_server.url) as nc:
        loop = _loop(nc, spec, always_fails, metrics)
        task = asyncio.create_task(loop.run())
        ack = await Publisher(nc.jetstream(), FAST_BUS).publish(
            spec.filter_subject, b"poison", msg_id=unique(), headers={"Trace-Id": "abc"}
        )
        dead = await asyncio.wait_for(_dead_letters(nc, JOBS.name, ack.seq), 15)
        loop.stop()
        await asyncio.wait_for(task, 5)

    assert attempts == [1, 2, 3]
    assert dead.data == b"poison"
    h = dead.headers
    assert "model exploded" in h[subjects.HDR_DLQ_REASON] and "failed 3 times" in h[subjects.HDR_DLQ_REASON]
    assert h[subjects.HDR_DLQ_DELIVERIES] == "3"
    assert h[subjects.HDR_DLQ_SUBJECT] == spec.filter_subject
    assert h[subjects.HDR_DLQ_STREAM] == JOBS.name and h[subjects.HDR_DLQ_CONSUMER] == spec.durable
    assert h["Trace-Id"] == "abc"
    labels = {"subject": spec.filter_subject}
    assert metrics.registry.get_sample_value("kvmesh_messages_failed_total", labels) == 3
    assert metrics.registry.get_sample_value("kvmesh_messages_redelivered_total", labels) == 2
    assert metrics.registry.get_sample_value("kvmesh_messages_dead_lettered_total", labels) == 1


async def test_undecodable_message_is_dead_lettered_at_once(nats_server):
    worker = unique("w")
    spec = ConsumerSpec(JOBS.name, f"prefill-{worker}", subjects.jobs_prefill(worker), ack_wait_s=2.0)
    seen: list[ErrorReply] = []

    async def handle(reply: ErrorReply, msg: Msg) -> None:
        seen.append(reply)

    async with connected(nats_server.url) as nc:
        loop = _loop(nc, spec, typed(ErrorReply, handle))
        task = asyncio.create_task(loop.run())
        pub = Publisher(nc.jetstream(), FAST_BUS)
        await pub.publish(spec.filter_subject, ErrorReply(error="fine"), msg_id=unique())
        bad = await pub.publish(spec.filter_subject, b'{"schema_version": 99, "error": "x"}', msg_id=unique())
        dead = await asyncio.wait_for(_dead_letters(nc, JOBS.name, bad.seq), 10)
        loop.stop()
        await asyncio.wait_for(task, 5)
    assert [r.error for r in seen] == ["fine"]
    assert dead.headers[subjects.HDR_DLQ_DELIVERIES] == "1"
    assert "unsupported schema_version 99" in dead.headers[subjects.HDR_DLQ_REASON]


async def test_long_handler_is_kept_alive_and_drain_waits_for_it(nats_server):
    worker = unique("w")
    spec = ConsumerSpec(JOBS.name, f"prefill-{worker}", subjects.jobs_prefill(worker), ack_wait_s=1.0)
    started = asyncio.Event()
    deliveries: list[int] = []

    async def slow(msg: Msg) -> None:
        deliveries.append(msg.metadata.num_delivered)
        started.set()
        await asyncio.sleep(2.5)  # the work itself: longer than ack_wait, kept alive by in_progress()

    async with connected(nats_server.url) as nc:
        loop = _loop(nc, spec, slow, drain_s=10.0)
        task = asyncio.create_task(loop.run())
        await Publisher(nc.jetstream(), FAST_BUS).publish(spec.filter_subject, b"long", msg_id=unique())
        await asyncio.wait_for(started.wait(), 5)
        t0 = time.monotonic()
        # Keep fetching past ack_wait: without in_progress() the server would redeliver to this loop now.
        await eventually(lambda: time.monotonic() - t0 > 1.6, 3, "ack_wait to pass while the handler runs")
        loop.stop()  # drain: stop fetching, let the in-flight handler finish and ack
        await asyncio.wait_for(task, 10)
        info = await nc.jetstream().consumer_info(JOBS.name, spec.durable)
    assert deliveries == [1]
    assert info.num_ack_pending == 0 and info.num_redelivered == 0 and info.num_pending == 0


async def test_permanent_error_skips_retries(nats_server):
    worker = unique("w")
    spec = ConsumerSpec(JOBS.name, f"prefill-{worker}", subjects.jobs_prefill(worker), ack_wait_s=2.0)
    calls: list[int] = []

    async def refuse(msg: Msg) -> None:
        calls.append(msg.metadata.num_delivered)
        raise PermanentError("prompt longer than the model's context")

    async with connected(nats_server.url) as nc:
        dead = await _dead_letter_of_one(nc, spec, refuse)
    assert calls == [1]
    assert "context" in dead.headers[subjects.HDR_DLQ_REASON]


async def test_hung_handler_times_out_and_is_dead_lettered(nats_server):
    worker = unique("w")
    spec = ConsumerSpec(JOBS.name, f"prefill-{worker}", subjects.jobs_prefill(worker), ack_wait_s=1.0,
                        max_deliver=1, handler_timeout_s=0.5)

    async def hang(msg: Msg) -> None:
        await asyncio.Event().wait()

    async with connected(nats_server.url) as nc:
        dead = await _dead_letter_of_one(nc, spec, hang)
    assert "handler timed out after 0.5s" in dead.headers[subjects.HDR_DLQ_REASON]


async def test_message_whose_last_attempt_died_is_dead_lettered_not_dropped(nats_server):
    worker = unique("w")
    spec = ConsumerSpec(JOBS.name, f"decode-{worker}", subjects.jobs_decode(worker), ack_wait_s=1.0, max_deliver=1)
    async with connected(nats_server.url) as nc_b:
        ack, _ = await _crash_holding_the_next(nats_server.url, spec, nc_b, b"x")  # the only attempt

        calls: list[int] = []

        async def never_called(msg: Msg) -> None:
            calls.append(msg.metadata.num_delivered)

        loop_b = _loop(nc_b, spec, never_called)
        task_b = asyncio.create_task(loop_b.run())
        dead = await asyncio.wait_for(_dead_letters(nc_b, JOBS.name, ack.seq), 10)
        loop_b.stop()
        await asyncio.wait_for(task_b, 5)
    assert calls == []
    assert "no verdict after 1 deliveries" in dead.headers[subjects.HDR_DLQ_REASON]
    assert dead.headers[subjects.HDR_DLQ_DELIVERIES] == "2"


async def test_request_id_travels_with_the_message(nats_server):
    worker = unique("w")
    spec = ConsumerSpec(JOBS.name, f"prefill-{worker}", subjects.jobs_prefill(worker), ack_wait_s=2.0)
    seen: list[dict] = []

    async def handle(msg: Msg) -> None:
        seen.append(structlog.contextvars.get_contextvars())

    async with connected(nats_server.url) as nc:
        loop = _loop(nc, spec, handle)
        task = asyncio.create_task(loop.run())
        with bind_request(request_id="req-42", session_id="sess-1"):
            await Publisher(nc.jetstream(), FAST_BUS).publish(spec.filter_subject, b"x", msg_id=unique())
        await eventually(lambda: len(seen) == 1, 5, "the handler to run")
        loop.stop()
        await asyncio.wait_for(task, 5)
    assert seen[0]["request_id"] == "req-42" and seen[0]["session_id"] == "sess-1"
    assert seen[0]["subject"] == spec.filter_subject


async def test_max_handlers_runs_that_many_at_once(nats_server):
    """A job consumer holds a handler per request until its last token: it runs `max_handlers` at once, not the
    bus's `fetch_batch` (4 here), so the 5th job starts while the first four still run."""
    worker = unique("w")
    spec = ConsumerSpec(JOBS.name, f"prefill-{worker}", subjects.jobs_prefill(worker), max_handlers=10)
    running: set[bytes] = set()
    release = asyncio.Event()

    async def hold(msg: Msg) -> None:
        running.add(msg.data)
        await release.wait()

    async with connected(nats_server.url) as nc:
        loop = _loop(nc, spec, hold)
        task = asyncio.create_task(loop.run())
        publisher = Publisher(nc.jetstream(), FAST_BUS)
        for i in range(10):
            await publisher.publish(spec.filter_subject, f"job-{i}".encode(), msg_id=unique())
        await eventually(lambda: len(running) == 10, 10, "all ten jobs running at once")
        release.set()
        loop.stop()
        await asyncio.wait_for(task, 10)
        info = await nc.jetstream().consumer_info(JOBS.name, spec.durable)
    assert info.num_ack_pending == 0 and info.num_pending == 0
