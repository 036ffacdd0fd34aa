"""API keys -> tenants -> cache salts.

Keys come from `KVMESH_API_KEYS` (`key:tenant,key:tenant`) or the keys file
(one `key:tenant` per line; `#` comments). A tenant's salt is
HMAC-SHA256(server secret, tenant), computed here from the authenticated
tenant and never from anything the client sends, so two tenants' identical
prompts hash to different blocks. The secret is the deployment's, shared by
every replica (shared/ingress/admission/salt_secret.py says where it comes from).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request
from kvmesh.ingress.core.errors import ApiError, ErrorKind

KEYS_FILE = "api_keys"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: the tenant its key maps to and that tenant's salt (hex)."""

    key_id: str  # a short, loggable digest of the key (never the key itself)
    tenant: str
    salt: str


def parse_keys(text: str) -> dict[str, str]:
    """`key:tenant` entries separated by commas or newlines -> {key: tenant}; ValueError on a bad entry."""
    keys: dict[str, str] = {}
    for raw in text.replace(",", "\n").splitlines():
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        key, sep, tenant = entry.partition(":")
        if not sep or not key.strip() or not tenant.strip():
            raise ValueError(f"bad API key entry (want key:tenant): {entry[:8]}...")
        keys[key.strip()] = tenant.strip()
    return keys


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def ensure_dev_key(keys_file: Path, tenant: str = "dev") -> str | None:
    """Create a keys file with one fresh key for `tenant` if none exists; returns the new key (or None)."""
    if keys_file.exists():
        return None
    key = "sk-kvmesh-" + secrets.token_urlsafe(24)
    try:
        _write_private(keys_file, f"{key}:{tenant}\n")
    except FileExistsError:
        return None
    return key


class KeyRing:
    """Authenticates requests: Bearer token or `x-api-key` -> `Principal`."""

    __slots__ = ("_keys", "_secret")

    def __init__(self, keys: dict[str, str], secret: bytes) -> None:
        self._keys = dict(keys)
        self._secret = secret

    @classmethod
    def from_settings(cls, api_keys: str | None, keys_file: Path | None, state_dir: Path, secret: bytes
                      ) -> KeyRing:
        """Keys from `api_keys`, else the keys file (default `<state_dir>/api_keys`); salts from `secret`."""
        path = keys_file or state_dir / KEYS_FILE
        text = api_keys if api_keys else (path.read_text() if path.is_file() else "")
        return cls(parse_keys(text), secret)

    def __len__(self) -> int:
        return len(self._keys)

    def salt(self, tenant: str) -> str:
        return hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()

    def lookup(self, key: str) -> Principal | None:
        # compare_digest over every key: the time taken does not tell which prefix matched
        found = None
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        if found is None:
            return None
        return Principal(hashlib.sha256(key.encode()).hexdigest()[:12], found, self.salt(found))

    def authenticate(self, request: Request) -> Principal:
        """The caller's principal, or ApiError(authentication) for a missing or unknown key."""
        key = request.headers.get("x-api-key", "")
        auth = request.headers.get("authorization", "")
        if not key and auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        if not key:
            raise ApiError(ErrorKind.AUTHENTICATION, "missing API key: send Authorization: Bearer <key> or x-api-key")
        principal = self.lookup(key)
        if principal is None:
            raise ApiError(ErrorKind.AUTHENTICATION, "invalid API key")
        return principal
