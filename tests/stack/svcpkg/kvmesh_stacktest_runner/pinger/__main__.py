"""A service on the real runner (kvmesh.service.runner) for the stack tests: nothing but its heartbeat.

`kvmesh up` must give it what every kvmesh service needs: NATS URL, worker
id, HTTP port, and declared streams (the `workers` bucket its heartbeat
writes to).
"""

from kvmesh.protocol.messages import Role
from kvmesh.service.runner import ServiceContext, run_service


async def setup(ctx: ServiceContext) -> None:
    ctx.capacity = 1.0


raise SystemExit(run_service("pinger", Role.TEST, setup))
