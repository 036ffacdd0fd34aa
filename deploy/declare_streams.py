"""Declare kvmesh's JetStream streams, consumers and KV buckets, then exit.

The one-shot step a container deployment runs before any service (a compose
service, a Kubernetes init container): the service runner only binds its
consumers, it never creates shared streams. Reads KVMESH_NATS_URL and
KVMESH_NATS__REPLICAS like every service; idempotent (create-or-update), so
every pod may run it. NATS may still be forming its cluster: keep trying for
`--wait` seconds, then exit 1 with the last error.
"""

from __future__ import annotations

import argparse
import sys
import time

from shared.config import load_settings
from shared.stack.declare import declare_streams
from shared.stack.errors import StackError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wait", type=float, default=120.0, help="keep retrying this many seconds")
    args = parser.parse_args(argv)
    settings = load_settings()
    if not settings.nats_url:
        print("declare_streams: KVMESH_NATS_URL is not set", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait
    while True:
        try:
            declare_streams(settings.nats_url, settings.nats.replicas)
        except StackError as exc:
            if time.monotonic() >= deadline:
                print(f"declare_streams: {exc.message}", file=sys.stderr)
                return 1
            time.sleep(2.0)
            continue
        print(f"declare_streams: streams declared on {settings.nats_url} (replicas={settings.nats.replicas})")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
