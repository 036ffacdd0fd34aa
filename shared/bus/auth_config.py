"""The nats-server side of bus authentication: users with passwords and permissions, rendered as config text.

`render_accounts` writes the `accounts { KVMESH {...} SYS {...} }` and
`system_account` blocks of a nats-server config: every kvmesh user lives in
the KVMESH account, the only one with JetStream (so every stream and bucket
is that account's), and SYS holds one user for the server's own system
events. Passwords are written as given (plain text): the file that holds
them must be private (mode 0600), as shared/stack/servers.py writes it.
nats-server also takes bcrypt hashes (`$2a$...`, e.g. from `nats server
passwd`) in the same field; kvmesh does not hash because clients need the
plain password from the same state dir anyway.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.bus.permissions import Permissions

KVMESH_ACCOUNT = "KVMESH"
SYSTEM_ACCOUNT = "SYS"
SYSTEM_USER = "sys"


@dataclass(frozen=True, slots=True)
class NatsUser:
    name: str
    password: str
    permissions: Permissions


def _q(value: str) -> str:
    """A quoted config string (JSON quoting is valid nats-server config; `$` inside quotes is literal)."""
    return json.dumps(value)


def _list(values: Sequence[str]) -> str:
    return "[" + ", ".join(_q(v) for v in values) + "]"


def render_permissions(p: Permissions) -> str:
    parts = [f"publish: {{allow: {_list(p.publish)}}}", f"subscribe: {{allow: {_list(p.subscribe)}}}"]
    if p.responses:
        parts.append(f"allow_responses: {{max: {p.responses}}}")
    return "{" + ", ".join(parts) + "}"


def render_accounts(users: Sequence[NatsUser], system_password: str) -> str:
    """The accounts and system_account blocks for `users` (all in KVMESH) and the SYS user."""
    names = [u.name for u in users]
    if len(set(names)) != len(names) or SYSTEM_USER in names:
        raise ValueError(f"user names must be unique and not {SYSTEM_USER!r}: {names}")
    lines = ["accounts {", f"  {KVMESH_ACCOUNT} {{", "    jetstream: enabled", "    users: ["]
    for u in users:
        lines.append(f"      {{user: {_q(u.name)}, password: {_q(u.password)}, "
                     f"permissions: {render_permissions(u.permissions)}}}")
    lines += ["    ]", "  }",
              f"  {SYSTEM_ACCOUNT} {{ users: [{{user: {_q(SYSTEM_USER)}, password: {_q(system_password)}}}] }}",
              "}", f"system_account: {SYSTEM_ACCOUNT}"]
    return "\n".join(lines) + "\n"
