"""The deployment's salt secret: every tenant's cache salt is HMAC(secret, tenant).

All ingress replicas of a deployment, and every restart of one, must hold the
same secret: a different secret gives the same tenant different salts, so its
blocks hash differently (a cold cache) and what it stored under the old salt
(L3 objects, named caches) is no longer found. The ingress therefore never
makes one up. Sources, first found wins:

1. `KVMESH_INGRESS_SECRET` (`Settings.ingress_secret`), hex;
2. the file `ingress.secret_file` (where Kubernetes mounts a Secret), hex;
3. `<state_dir>/ingress_secret`, which only the local stack (`kvmesh up`,
   "dev mode") creates, once, with mode 0600.

None of them -> `SecretError`, and the ingress refuses to start. A secret
must decode to at least `MIN_SECRET_BYTES` bytes.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

STATE_FILE = "ingress_secret"
MIN_SECRET_BYTES = 32


class SecretError(RuntimeError):
    """No usable salt secret: the message says where one was looked for and how to provide it."""


def parse_secret(text: str, source: str) -> bytes:
    """Hex text -> the secret's bytes; SecretError naming `source` (never the value) if it is unusable."""
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise SecretError(f"the ingress secret from {source} is not hex") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the ingress secret from {source} has {len(secret)} bytes; at least "
                          f"{MIN_SECRET_BYTES} are needed (`openssl rand -hex 32` makes one)")
    return secret


def _read(path: Path, source: str) -> bytes:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SecretError(f"cannot read the ingress secret file {path} ({source}): {exc.strerror}") from None
    return parse_secret(text, f"{source} ({path})")


def load_secret(env_value: str | None, secret_file: Path | None, state_dir: Path) -> bytes:
    """The secret from the first configured source (see the module docstring), or SecretError.

    A source that is configured but unusable (bad hex, too short, unreadable file) is an error, not a
    fall-through: silently using another secret would split the deployment's salts."""
    if env_value:
        return parse_secret(env_value, "KVMESH_INGRESS_SECRET")
    if secret_file is not None:
        return _read(secret_file, "ingress.secret_file")
    dev = state_dir / STATE_FILE
    if dev.exists():
        return _read(dev, "the state dir")
    raise SecretError(
        "no ingress salt secret: set KVMESH_INGRESS_SECRET (hex, >= 32 bytes, e.g. `openssl rand -hex 32`) "
        f"or KVMESH_INGRESS__SECRET_FILE, or create {dev} (`kvmesh up` does that for the local stack). "
        "Every ingress replica of a deployment must share the same secret.")


def ensure_dev_secret(state_dir: Path) -> bool:
    """Create `<state_dir>/ingress_secret` (0600 from the first byte) unless it exists; True if created."""
    path = state_dir / STATE_FILE
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # a concurrent `kvmesh up` made it first: theirs is as good
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(MIN_SECRET_BYTES) + "\n")
    return True
