"""NATS users of the local stack: one per service process plus `admin`, passwords generated once into the state dir.

The file (`nats-credentials.json`, mode 0600) maps user name -> role and
password; a user is added the first time a stack needs it (more replicas)
and kept after, so restarts reuse every password. The `admin` user (stream
declaration, CLI, benches) may do anything in the KVMESH account; a service
is held to its role's permissions for its own id (shared/bus/permissions.py).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bus.auth_config import NatsUser
from kvmesh.bus.client_auth import ClientAuth
from kvmesh.bus.permissions import ADMIN, ROLES, inbox_prefix, permissions
from kvmesh.credentials.nats_access import NatsAuth, write_private

NATS_CREDENTIALS_FILE = "nats-credentials.json"
ADMIN_USER = "admin"


@dataclass(frozen=True, slots=True)
class NatsCredentials:
    users: dict[str, tuple[str, str]]  # user name -> (role, password)
    system_password: str

    def server_auth(self) -> NatsAuth:
        """The users as nats-server admits them: a service user's permissions name its own id; a user named
        after its role (`vllm`: instances the stack does not start) is the per-role user, any id of it."""
        users = tuple(NatsUser(name, password, permissions(role, None if name == role else name))
                      for name, (role, password) in sorted(self.users.items()))
        return NatsAuth(users=users, system_password=self.system_password)

    def client(self, user: str, inbox_id: str | None = None) -> ClientAuth:
        """How `user` connects (its inbox prefix is `_INBOX.<role>.<inbox_id or user>`)."""
        role, password = self.users[user]
        return ClientAuth(user=user, password=password, inbox_prefix=inbox_prefix(role, inbox_id or user))

    def admin(self) -> ClientAuth:
        return self.client(ADMIN_USER)


def service_role(service_name: str) -> str:
    """The permissions role of a service package (`cache_index` -> `cache-index`); any other service is admin."""
    role = service_name.replace("_", "-")
    return role if role in ROLES and role != ADMIN else ADMIN


def read_nats_credentials(state_dir: Path) -> NatsCredentials | None:
    """The stored users, or None when there are none (or the file cannot be read)."""
    try:
        data = json.loads((state_dir / NATS_CREDENTIALS_FILE).read_text())
        users = {str(n): (str(u["role"]), str(u["password"])) for n, u in data["users"].items()}
        return NatsCredentials(users=users, system_password=str(data["system_password"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_or_create_nats_credentials(state_dir: Path, wanted: dict[str, str]) -> NatsCredentials:
    """The stored users plus a new random password for each of `wanted` (name -> role) not stored yet, and admin."""
    wanted = {ADMIN_USER: ADMIN, **wanted}
    for name, role in wanted.items():
        if role not in ROLES:
            raise ValueError(f"user {name!r}: unknown role {role!r}")
    stored = read_nats_credentials(state_dir)
    users = dict(stored.users) if stored else {}
    missing = {n: r for n, r in wanted.items() if users.get(n, ("", ""))[0] != r}
    if stored is not None and not missing:
        return stored
    users.update({n: (r, secrets.token_urlsafe(24)) for n, r in missing.items()})
    creds = NatsCredentials(users=users, system_password=stored.system_password if stored else secrets.token_urlsafe(24))
    body = {"users": {n: {"role": r, "password": p} for n, (r, p) in users.items()},
            "system_password": creds.system_password}
    state_dir.mkdir(parents=True, exist_ok=True)
    write_private(state_dir / NATS_CREDENTIALS_FILE, json.dumps(body, indent=1))
    return creds


def admin_auth(state_dir: Path) -> ClientAuth | None:
    """The admin user of the stack in `state_dir` (None: that stack runs without NATS auth)."""
    creds = read_nats_credentials(state_dir)
    return creds.admin() if creds and ADMIN_USER in creds.users else None
