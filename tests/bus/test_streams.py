"""Stream, consumer and bucket declaration against a real nats-server."""

from __future__ import annotations

from dataclasses import replace

from kvmesh.protocol import streams
from kvmesh.protocol.streams import StreamSpec, declare_all, declare_stream
from nats.js import api

from .helpers import connected, unique


async def test_declare_all_is_idempotent(nats_server):
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        await declare_all(js)  # second time (connected() declared once): no error, same config
        for spec in streams.ALL_STREAMS:
            info = await js.stream_info(spec.name)
            assert info.config.max_bytes == spec.max_bytes
            assert info.config.max_msg_size == spec.max_msg_size
            assert info.config.max_age == spec.max_age_s
            assert info.config.duplicate_window == min(spec.duplicate_window_s, spec.max_age_s)
            assert info.config.storage == api.StorageType.FILE
        workers = await js.stream_info(streams.WORKERS.stream_name)
        assert workers.config.allow_msg_ttl is True
        assert workers.config.subject_delete_marker_ttl == streams.WORKERS.marker_ttl_s
        for consumer in streams.ALL_CONSUMERS:
            ci = await js.consumer_info(consumer.stream, consumer.durable)
            assert ci.config.filter_subject == consumer.filter_subject
            assert ci.config.max_deliver == consumer.max_deliver + 1


async def test_changed_limit_updates_existing_stream(nats_server):
    name = unique("S").upper()
    spec = StreamSpec(name, (f"{name.lower()}.>",), max_age_s=60.0, max_bytes=1 << 20, max_msg_size=1024)
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        await declare_stream(js, spec.config())
        await js.publish(f"{name.lower()}.a", b"kept")
        await declare_stream(js, spec.config())  # unchanged: a no-op
        bigger = replace(spec, max_bytes=4 << 20, max_msg_size=4096, max_age_s=120.0)
        info = await declare_stream(js, bigger.config())
        assert (info.config.max_bytes, info.config.max_msg_size, info.config.max_age) == (4 << 20, 4096, 120.0)
        assert info.state.messages == 1  # updated in place, not recreated
        await js.delete_stream(name)


async def test_a_per_worker_stream_takes_more_than_the_servers_default_1000_consumers(fresh_nats_server):
    """nats-server refuses the 1,001st consumer of a stream whose config sets no max_consumers; JOBS holds a
    durable per worker and role, so a fleet of 1,000 workers needs more (shown on a stream of the same spec
    without the setting, whose 1,001st is refused)."""
    async with connected(fresh_nats_server.url) as nc:
        js = nc.jetstream()
        capped = replace(streams.JOBS, name="CAPPED", subjects=("capped.>",), max_consumers=-1)
        await declare_stream(js, capped.config())
        for name, prefix in ((streams.JOBS.name, "kvmesh.jobs.prefill"), ("CAPPED", "capped")):
            made = 0
            for i in range(1001):
                config = api.ConsumerConfig(durable_name=f"w{i}", filter_subject=f"{prefix}.w{i}",
                                            ack_policy=api.AckPolicy.EXPLICIT)
                try:
                    await js.add_consumer(name, config)
                except Exception:  # noqa: BLE001 - the server's "maximum consumers limit reached"
                    break
                made += 1
            assert made == (1001 if name == streams.JOBS.name else 1000), name


def test_a_stream_the_release_cannot_update_stops_up_with_what_to_do(fresh_nats_server):
    """A state dir whose JOBS stream was made with another storage type (not changeable in place): `kvmesh up`'s
    declaration fails at once with one message naming the stream and the ways on, and deletes nothing."""
    import asyncio

    import nats
    import pytest
    from kvmesh.stack.declare import declare_streams
    from kvmesh.stack.errors import StackError

    async def older_release() -> None:
        nc = await nats.connect(fresh_nats_server.url)
        js = nc.jetstream()
        await js.add_stream(replace(streams.JOBS.config(), storage=api.StorageType.MEMORY))
        await js.publish("kvmesh.jobs.prefill.any", b"an acknowledged job")
        await nc.close()

    async def jobs_messages() -> int:
        nc = await nats.connect(fresh_nats_server.url)
        try:
            return (await nc.jetstream().stream_info(streams.JOBS.name)).state.messages
        finally:
            await nc.close()

    asyncio.run(older_release())
    with pytest.raises(StackError) as failed:
        declare_streams(fresh_nats_server.url, replicas=1, timeout_s=60)
    message = str(failed.value)
    assert "stream JOBS" in message and "--fresh" in message and "storage" in message.lower(), message
    assert asyncio.run(jobs_messages()) == 1
