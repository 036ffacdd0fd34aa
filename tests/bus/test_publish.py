"""Publishing with Nats-Msg-Id dedup and a retry that rides out a NATS restart."""

from __future__ import annotations

import asyncio
import re

import pytest
from kvmesh.bus.connection import close, connect
from kvmesh.bus.publish import Publisher, PublishError, is_transient
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.streams import KV_EVENTS, declare_all
from waits import until

from .helpers import FAST_BUS, connected, unique


def _retries(metrics: ServiceMetrics) -> float:
    """Publish retries counted for the KV-event subjects (the family the tests publish to)."""
    return metrics.registry.get_sample_value("kvmesh_publish_retries_total", {"subject": "kvmesh.kv"}) or 0.0


async def test_duplicate_msg_id_is_stored_once(nats_server):
    subject = subjects.kv_events(unique("w"))
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        pub = Publisher(js, FAST_BUS)
        first = await pub.publish(subject, b"block-stored", msg_id="evt-1")
        again = await pub.publish(subject, b"block-stored", msg_id="evt-1")
        other = await pub.publish(subject, b"block-removed", msg_id="evt-2")
        assert again.duplicate and again.seq == first.seq
        assert not other.duplicate
        info = await js.stream_info(KV_EVENTS.name, subjects_filter=subject)
        assert info.state.subjects == {subject: 2}


async def test_publish_rides_out_nats_restart(fresh_nats_server):
    server = fresh_nats_server
    subject = subjects.kv_events("restart")
    metrics = ServiceMetrics.create("test")
    nc = await connect(server.url, "restart-test", FAST_BUS)
    try:
        js = nc.jetstream()
        await declare_all(js)
        pub = Publisher(js, FAST_BUS, metrics)
        await pub.publish(subject, b"before", msg_id="m-0")

        server.stop()
        during = asyncio.create_task(pub.publish(subject, b"during", msg_id="m-1"))
        # NATS comes back only once the publish has failed and retried: the outage is one it rode out.
        await until(lambda: _retries(metrics) >= 1, 20, "a publish retry while NATS is down")
        assert not during.done()
        await asyncio.to_thread(server.start)  # same port, same data dir
        ack = await during
        assert ack.seq == 2 and not ack.duplicate
        info = await js.stream_info(KV_EVENTS.name, subjects_filter=subject)
        assert info.state.subjects == {subject: 2}  # persisted once, the earlier one survived the restart
    finally:
        await nc.close()


async def test_publish_gives_up_after_its_budget(fresh_nats_server):
    settings = FAST_BUS.model_copy(update={"publish_retry_total_s": 1.0, "publish_timeout_s": 0.3})
    metrics = ServiceMetrics.create("test")
    nc = await connect(fresh_nats_server.url, "gives-up", settings)
    try:
        await declare_all(nc.jetstream())
        fresh_nats_server.stop()  # and never comes back
        failed = r"publish to kvmesh\.kv\.events\.w1 \(msg id m-1\) failed after \d+ attempts"
        with pytest.raises(PublishError, match=failed) as err:
            await Publisher(nc.jetstream(), settings, metrics).publish(subjects.kv_events("w1"), b"x", msg_id="m-1")
        # It retried until the budget ran out: every failure but the last was counted as a retry, and the
        # last was still transient (a permanent error propagates at once, as itself).
        attempts = int(re.search(r"after (\d+) attempts", str(err.value)).group(1))
        assert attempts >= 2 and _retries(metrics) == attempts - 1
        assert is_transient(err.value.__cause__)
    finally:
        await close(nc)
