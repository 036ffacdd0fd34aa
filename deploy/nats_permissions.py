"""Write the Helm chart's copy of the NATS permission table (helm/kvmesh/files/nats-permissions.json).

Helm cannot run Python, so the chart reads its NATS users' allow-lists from a
JSON file generated from shared/bus/permissions.py: one per-role user per
role (a Deployment's pod names are not known in advance, so every own-id rule
reads `*`). Each entry is already in nats-server's `permissions` shape, so the
template writes it with `toJson`. tests/deploy/test_chart_nats_auth.py fails
when the file and the table differ; rerun this then:

    python deploy/nats_permissions.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvmesh.bus.permissions import ROLES, Permissions, permissions

CHART_FILE = Path(__file__).resolve().parents[1] / "helm" / "kvmesh" / "files" / "nats-permissions.json"


def server_permissions(p: Permissions) -> dict:
    """nats-server's `permissions` block for one user, as JSON (a valid nats-server config value)."""
    out: dict = {"publish": {"allow": list(p.publish)}, "subscribe": {"allow": list(p.subscribe)}}
    if p.responses:
        out["allow_responses"] = {"max": p.responses}
    return out


def chart_table() -> dict[str, dict]:
    """Role -> nats-server permissions of that role's per-role user."""
    return {role: server_permissions(permissions(role)) for role in ROLES}


def render() -> str:
    return json.dumps(chart_table(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write (or --check) the chart's NATS permission table.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the chart's file is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = CHART_FILE.read_text() if CHART_FILE.exists() else ""
        if current != text:
            print(f"{CHART_FILE} is out of date: run python deploy/nats_permissions.py", file=sys.stderr)
            return 1
        return 0
    CHART_FILE.parent.mkdir(parents=True, exist_ok=True)
    CHART_FILE.write_text(text)
    print(f"wrote {CHART_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
