"""Make the compose stack's secrets once, then write the files each container reads them from.

Compose runs no Python at `up` time except in containers, so the `secrets`
one-shot service runs this (in the kvmesh image) before anything else:

- `<secrets-dir>/generated.json` (0600): the values, generated on the first
  run and only read afterwards, so every restart and every `--scale`d
  replica sees the same ones: the ingress salt secret, the bucket-scoped S3
  user's secret key, one NATS password per role.
- `<secrets-dir>/ingress-secret`: the salt secret as hex
  (`KVMESH_INGRESS__SECRET_FILE`). A new one means a cold cache.
- `<secrets-dir>/<service>.env`: `KEY=value` lines a service sources before
  it starts: its NATS user and password (the role's), the S3 services key.
  `declare.env` holds the admin user; `minio-init.env` the S3 user to create.
- `<nats-dir>/accounts.conf`: the nats-server users, rendered from the one
  permission table (shared/bus/permissions.py) on every run, so the
  config follows the code while the passwords stay.

Per-role users (not per-id): compose names replicas at `--scale` time.
`--rotate NAME` replaces one generated value (see docs/deploy.md).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

from kvmesh.bus.auth_config import NatsUser, render_accounts
from kvmesh.bus.permissions import ADMIN, ROLES, permissions

# compose service -> the NATS role it connects as
SERVICE_ROLES = {"ingress": "ingress", "prefill": "prefill", "decode": "decode",
                 "cache-index": "cache-index", "eviction": "eviction", "declare": ADMIN}
S3_USER = "kvmesh-services"
SALT_BYTES = 32
ROTATABLE = ("ingress-secret", "s3", "nats")


def _fresh() -> dict:
    return {"ingress_secret": secrets.token_hex(SALT_BYTES), "s3_secret_key": secrets.token_hex(20),
            "nats": {role: secrets.token_hex(24) for role in ROLES}, "nats_system": secrets.token_hex(24)}


def generated(path: Path, rotate: tuple[str, ...] = ()) -> dict:
    """The stored values, completed with fresh ones for anything missing (a role added later) or rotated."""
    stored = json.loads(path.read_text()) if path.exists() else {}
    fresh = _fresh()
    for name in rotate:
        stored.pop({"ingress-secret": "ingress_secret", "s3": "s3_secret_key"}.get(name, name), None)
    out = {k: stored.get(k, v) for k, v in fresh.items()}
    out["nats"] = {role: stored.get("nats", {}).get(role, pw) for role, pw in fresh["nats"].items()}
    return out


def write_private(path: Path, text: str) -> None:
    """Write owner-only (0600) via a temp file, so a reader never sees a half-written or world-readable file."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _env(pairs: dict[str, str]) -> str:
    # values are hex or fixed names: nothing a shell's `.` would need quoted
    return "".join(f"{k}={v}\n" for k, v in pairs.items())


def write_all(secrets_dir: Path, nats_dir: Path, rotate: tuple[str, ...] = ()) -> dict:
    """Create or complete the values and (re)write every derived file; returns the values."""
    values = generated(secrets_dir / "generated.json", rotate)
    write_private(secrets_dir / "generated.json", json.dumps(values, indent=2) + "\n")
    write_private(secrets_dir / "ingress-secret", values["ingress_secret"] + "\n")
    s3 = {"KVMESH_S3_ACCESS_KEY": S3_USER, "KVMESH_S3_SECRET_KEY": values["s3_secret_key"]}
    for service, role in SERVICE_ROLES.items():
        nats = {"KVMESH_NATS_USER": role, "KVMESH_NATS_PASSWORD": values["nats"][role]}
        write_private(secrets_dir / f"{service}.env", _env(nats if role == ADMIN else {**nats, **s3}))
    write_private(secrets_dir / "minio-init.env", _env(s3))
    users = [NatsUser(role, values["nats"][role], permissions(role)) for role in ROLES]
    write_private(nats_dir / "accounts.conf", render_accounts(users, values["nats_system"]))
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make the compose stack's secrets (once) and their files.")
    parser.add_argument("--secrets-dir", type=Path, default=Path("/etc/kvmesh/secrets"))
    parser.add_argument("--nats-dir", type=Path, default=Path("/etc/kvmesh/nats-auth"))
    parser.add_argument("--rotate", action="append", choices=ROTATABLE, default=[],
                        help="replace this generated value (ingress-secret: a cold cache for every tenant)")
    args = parser.parse_args(argv)
    write_all(args.secrets_dir, args.nats_dir, tuple(args.rotate))
    print(f"secrets ready in {args.secrets_dir} and {args.nats_dir}"
          + (f" (rotated: {', '.join(args.rotate)})" if args.rotate else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
