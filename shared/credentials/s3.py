"""S3 credentials of the local stack: generated once, kept in the state dir (mode 0600), reused."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

CREDENTIALS_FILE = "s3-credentials.json"


@dataclass(frozen=True, slots=True)
class S3Credentials:
    access_key: str
    secret_key: str


def read_credentials(state_dir: Path) -> S3Credentials | None:
    """The stored pair, or None when there is none (or it cannot be read)."""
    try:
        data = json.loads((state_dir / CREDENTIALS_FILE).read_text())
        return S3Credentials(access_key=data["access_key"], secret_key=data["secret_key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_or_create_credentials(state_dir: Path) -> S3Credentials:
    """The stored pair, or a new random one written with mode 0600 from the first byte."""
    existing = read_credentials(state_dir)
    if existing is not None:
        return existing
    path = state_dir / CREDENTIALS_FILE
    path.unlink(missing_ok=True)  # an unreadable leftover; the S3 server gets the new pair too
    creds = S3Credentials(access_key="kvmesh-" + secrets.token_hex(8), secret_key=secrets.token_urlsafe(32))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"access_key": creds.access_key, "secret_key": creds.secret_key}, f)
    return creds
