"""A trivial service for the runner tests: a job is a number of seconds to work, then a 'done' event.

Run as a script (`python tests/service/sleepy_service.py`) with KVMESH_* env vars, like `kvmesh up`
runs `python -m kvmesh.services.<name>`.
"""

from __future__ import annotations

import asyncio

from kvmesh.protocol import subjects
from kvmesh.protocol.base import Message
from kvmesh.protocol.messages import Role
from kvmesh.protocol.streams import JOBS, ConsumerSpec
from kvmesh.service.runner import ServiceContext, run_service
from nats.aio.msg import Msg


class StatusQuery(Message):
    pass


class Status(Message):
    in_flight: int


def status_subject(worker_id: str) -> str:
    return f"kvmesh.test.status.{subjects.token(worker_id)}"


async def setup(ctx: ServiceContext) -> None:
    spec = ConsumerSpec(JOBS.name, f"prefill-{ctx.worker_id}", subjects.jobs_prefill(ctx.worker_id), ack_wait_s=2.0)

    async def work(msg: Msg) -> None:
        await asyncio.sleep(float(msg.data))
        seq = msg.metadata.sequence.stream
        await ctx.publisher.publish(subjects.kv_events(ctx.worker_id), b"done:" + msg.data, msg_id=f"done-{seq}")

    loop = ctx.add_consumer(spec, work)

    async def status(_: StatusQuery) -> Status:
        return Status(in_flight=loop.in_flight)

    ctx.add_endpoint(status_subject(ctx.worker_id), StatusQuery, status)


if __name__ == "__main__":
    raise SystemExit(run_service("sleepy", Role.TEST, setup))
