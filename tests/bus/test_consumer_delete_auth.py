"""With NATS users: a worker deletes its own consumers at drain, and only those (shared/bus/permissions.py)."""

from __future__ import annotations

import asyncio

from kvmesh.bus.consumer import ConsumerLoop
from kvmesh.bus.publish import Publisher
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.streams import JOBS, PREFILL_ANY, worker_consumer

from .helpers import FAST_BUS
from .test_auth import WAIT_S, bus  # noqa: F401 - the fixture: clients by user, streams declared by admin


async def _never(msg) -> None:
    raise AssertionError("no job is published here")


async def test_a_worker_deletes_its_own_consumer_and_no_other(bus) -> None:  # noqa: F811
    prefill, admin = await bus("prefill-0"), await bus("admin")
    own = worker_consumer(JOBS, "prefill", "prefill-0", subjects.jobs_prefill("prefill-0"))
    js = prefill.nc.jetstream(timeout=WAIT_S)
    metrics = ServiceMetrics.create("test")
    loop = ConsumerLoop(js, own, _never, Publisher(js, FAST_BUS, metrics), metrics, FAST_BUS, 5.0)
    task = asyncio.create_task(loop.run())
    await loop.wait_ready()
    assert own.durable in {c.name for c in await admin.nc.jetstream().consumers_info(JOBS.name)}
    loop.stop()
    await asyncio.wait_for(task, WAIT_S)
    assert prefill.errors.empty(), prefill.errors.get_nowait()
    assert own.durable not in {c.name for c in await admin.nc.jetstream().consumers_info(JOBS.name)}

    for durable in (PREFILL_ANY.durable, "prefill-prefill-1"):  # the shared queue, another worker's
        attempt = asyncio.ensure_future(js.delete_consumer(JOBS.name, durable))
        err = await prefill.refused()
        assert "permissions violation for publish" in err and f"consumer.delete.jobs.{durable}" in err
        attempt.cancel()
        await asyncio.gather(attempt, return_exceptions=True)
