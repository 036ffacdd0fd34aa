"""Stored responses (`store: true`) in the JetStream KV bucket `responses`, scoped by tenant, with a TTL.

Key: `<tenant scope>.<response id>`, the scope being a hash of the tenant,
so a tenant's lookup can only ever reach its own keys; the entry also names
its tenant and is checked on read. An entry holds the public response object
and the whole conversation it ends (input items after resolving its
`previous_response_id`, then its output items; instructions excluded), so a
follow-up reads one entry, never a chain. The conversation is bounded by the
model's context (a longer one could not have been answered), so an entry is
too, and a conversation of n turns stores O(n x context). Each write carries
the retention as its TTL (`ingress.response_retention_s`); reads also check
`expires_at`, so an entry is never served past its time. The bucket is in
the JetStream file store: stored responses survive an ingress restart.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from kvmesh.bus.kv_bucket import open_bucket
from kvmesh.protocol import subjects
from kvmesh.protocol.base import Message
from kvmesh.protocol.streams import RESPONSES
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError


class StoredResponse(Message):
    id: str
    tenant: str
    session: str  # the client-side session id of the conversation: follow-ups continue it
    created_at: float
    expires_at: float
    response: dict[str, Any]  # the public `response` object, as returned
    conversation: list[dict[str, Any]]  # input + output items, in order (instructions excluded)

    def live(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires_at


def tenant_scope(tenant: str) -> str:
    """A subject-safe, fixed-length token per tenant (tenant names need not be valid tokens)."""
    return "t-" + hashlib.sha256(b"kvmesh.responses.v1\x00" + tenant.encode()).hexdigest()[:32]


class ResponseStore:
    """Tenant-scoped access to the bucket; `get` answers None for another tenant's, an unknown or an expired id."""

    __slots__ = ("js", "_kv")

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv = None

    async def _bucket(self):
        if self._kv is None:
            self._kv = await open_bucket(self.js, RESPONSES)
        return self._kv

    @staticmethod
    def _key(tenant: str, response_id: str) -> str | None:
        try:
            return subjects.response_key(tenant_scope(tenant), response_id)
        except ValueError:  # not a token: no such response
            return None

    async def put(self, entry: StoredResponse) -> None:
        await self._bucket()
        key = self._key(entry.tenant, entry.id)
        if key is None:
            raise ValueError(f"not a response id: {entry.id!r}")
        ttl = max(1.0, entry.expires_at - time.time())
        await self.js.publish(f"$KV.{RESPONSES.name}.{key}", entry.to_bytes(), msg_ttl=ttl)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        key = self._key(tenant, response_id)
        if key is None:
            return None
        kv = await self._bucket()
        try:
            found = await kv.get(key)
        except KeyNotFoundError:
            return None
        if not found.value:
            return None
        entry = StoredResponse.from_bytes(found.value)
        return entry if entry.tenant == tenant and entry.live() else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget a response; False if the tenant has no such (live) response."""
        if await self.get(tenant, response_id) is None:
            return False
        kv = await self._bucket()
        await kv.delete(self._key(tenant, response_id))
        return True
