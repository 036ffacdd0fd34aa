"""Declare kvmesh's JetStream streams, consumers and KV buckets, then exit.

The one-shot step a container deployment runs before any service (a compose
service, a Kubernetes init container): the service runner only binds its
consumers, it never creates shared streams. Reads KVMESH_NATS_URL and
KVMESH_NATS__REPLICAS like every service, and connects as KVMESH_NATS_USER
(the `admin` role: the services' users may not create streams), with TLS
when KVMESH_NATS_TLS_* are set; idempotent (create-or-update), so
every pod may run it. NATS may still be starting or forming its cluster
(no JetStream quorum yet): keep trying for `--wait` seconds, then exit 1.
Logs are JSON lines on stderr, like the services'.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kvmesh.bus.client_auth import ClientAuth
from kvmesh.bus.connection import close, connect
from kvmesh.config import Settings, load_settings
from kvmesh.log import configure_logging, get_logger
from kvmesh.protocol.streams import declare_all

log = get_logger("declare_streams")
RETRY_S = 2.0


async def declare(settings: Settings, wait_s: float) -> None:
    """Connect (retrying up to wait_s) and declare everything, retrying JetStream errors until the same deadline."""
    deadline = time.monotonic() + wait_s
    bus = settings.bus.model_copy(update={"connect_retry_total_s": max(wait_s, 1.0)})
    nc = await connect(settings.nats_url or "", "declare-streams", bus, ClientAuth.from_settings(settings))
    try:
        while True:
            try:
                await declare_all(nc.jetstream(), replicas=settings.nats.replicas)
                return
            except Exception as exc:  # noqa: BLE001 - timeouts and JetStream API errors alike, until the deadline
                if time.monotonic() + RETRY_S >= deadline:
                    raise
                log.warning("declare failed, retrying", error=repr(exc), retry_in_s=RETRY_S)
                await asyncio.sleep(RETRY_S)
    finally:
        await close(nc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Declare kvmesh's JetStream streams, consumers and KV buckets.")
    parser.add_argument("--wait", type=float, default=120.0, help="keep retrying this many seconds")
    args = parser.parse_args(argv)
    settings = load_settings()
    configure_logging(settings.log_level, service="declare-streams")
    if not settings.nats_url:
        log.error("KVMESH_NATS_URL is not set")
        return 2
    try:
        asyncio.run(declare(settings, args.wait))
    except Exception as exc:  # noqa: BLE001 - any failure after the deadline: one line and exit 1
        log.error("declaring streams failed", nats_url=settings.nats_url, error=repr(exc))
        return 1
    log.info("streams declared", nats_url=settings.nats_url, replicas=settings.nats.replicas)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
