"""Worker ids for the consumer-churn tests: the consumers each prefill/decode worker declares, in its real shell.

`worker_settings` and `consumer_setup` build what `ServiceRunner` needs for
one emulated worker id: its own commands and job consumers
(`command_consumer`, `own_job_consumers`, as `setup_prefill`/`setup_decode`
declare them) and its role's shared queues, with a handler that is never
called (no jobs are published). Run as a script (`python churn_workers.py
URL INACTIVE_S ROLE:ID ...`) it hosts those workers in one process, prints
`ready` once every consumer is bound and waits to be killed: the abrupt end
(SIGKILL) the inactive threshold has to clean up after.
"""

from __future__ import annotations

import asyncio
import sys

from kvmesh.config import BusSettings, ServiceSettings, Settings
from kvmesh.protocol.messages import Role
from kvmesh.protocol.streams import DECODE_ANY, HANDOFF_ANY, PREFILL_ANY
from kvmesh.service.runner import ServiceContext, ServiceRunner, Setup
from kvmesh.serving.services import own_job_consumers
from kvmesh.serving.worker_commands import command_consumer
from nats.aio.msg import Msg

SHARED = {Role.PREFILL: (PREFILL_ANY,), Role.DECODE: (HANDOFF_ANY, DECODE_ANY)}


async def _never_called(msg: Msg) -> None:
    raise AssertionError(f"no message is published in the churn tests, got one on {msg.subject}")


def consumer_setup(role: Role) -> Setup:
    async def setup(ctx: ServiceContext) -> None:
        for spec in (command_consumer(ctx.worker_id), *own_job_consumers(role, ctx.worker_id), *SHARED[role]):
            ctx.add_consumer(spec, _never_called)
    return setup


def worker_settings(url: str, worker_id: str, bus: BusSettings) -> Settings:
    return Settings(nats_url=url, bus=bus,
                    service=ServiceSettings(worker_id=worker_id, http_port=0, drain_timeout_s=2.0))


def runner(url: str, role: Role, worker_id: str, bus: BusSettings) -> ServiceRunner:
    return ServiceRunner(role.value, role, consumer_setup(role), worker_settings(url, worker_id, bus))


async def _host(url: str, inactive_s: float, workers: list[tuple[Role, str]]) -> None:
    bus = BusSettings(worker_consumer_inactive_s=inactive_s, fetch_timeout_s=0.5)
    runners = [runner(url, role, wid, bus) for role, wid in workers]
    tasks = [asyncio.create_task(r.run()) for r in runners]
    await asyncio.gather(*(r.wait_started() for r in runners))
    if any(t.done() for t in tasks):
        raise SystemExit(f"a worker failed to start: {[t.result() for t in tasks if t.done()]}")
    print("ready", flush=True)
    await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    nats_url, inactive = sys.argv[1], float(sys.argv[2])
    ids = [(Role(arg.split(":")[0]), arg.split(":")[1]) for arg in sys.argv[3:]]
    asyncio.run(_host(nats_url, inactive, ids))
