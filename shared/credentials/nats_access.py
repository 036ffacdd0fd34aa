"""What a local nats-server is told about access: its users (NatsAuth) and its certificate (NatsTls).

The config text itself is rendered by shared/bus/auth_config.py (users) and
`NatsTls.config_lines`; shared/stack/servers.py puts them in the server's
config file, written with `write_private` because it then holds passwords.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bus.auth_config import NatsUser


@dataclass(frozen=True, slots=True)
class NatsAuth:
    """The users a NatsServer admits (all in the KVMESH account) and the SYS account's password."""

    users: tuple[NatsUser, ...]
    system_password: str


@dataclass(frozen=True, slots=True)
class NatsTls:
    """Server certificate and key; with `verify_clients`, clients need a certificate signed by `ca`."""

    cert: Path
    key: Path
    ca: Path | None = None
    verify_clients: bool = False

    def config_lines(self) -> list[str]:
        lines = ["tls {", f"  cert_file: {json.dumps(str(self.cert.resolve()))}",
                 f"  key_file: {json.dumps(str(self.key.resolve()))}"]
        if self.ca is not None:
            lines.append(f"  ca_file: {json.dumps(str(self.ca.resolve()))}")
        if self.verify_clients:
            lines.append("  verify: true")
        return [*lines, "}"]


def write_private(path: Path, text: str) -> None:
    """Write `text` to a file only its owner can read, from the first byte (a fresh inode every time)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
