"""Stored responses (`store: true`) in the JetStream KV bucket `responses`, scoped by tenant, with a TTL.

Key: `<tenant scope>.<response id>`, the scope being a hash of the tenant,
so a tenant's lookup can only ever reach its own keys; the entry also names
its tenant and is checked on read. An entry holds the public response object
and the whole conversation it ends (input items after resolving its
`previous_response_id`, then its output items; instructions excluded), so a
follow-up reads one entry, never a chain. The conversation is bounded by the
model's context (a longer one could not have been answered), so an entry is
too, and a conversation of n turns stores O(n x context). Each write carries
the retention as its TTL (`ingress.response_retention_s`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvmesh.ingress.core.entry_store import EntryStore, OwnedEntry
from kvmesh.protocol import subjects
from kvmesh.protocol.streams import RESPONSES
from nats.js import JetStreamContext


class StoredResponse(OwnedEntry):
    id: str
    session: str  # the client-side session id of the conversation: follow-ups continue it
    created_at: float
    response: dict[str, Any]  # the public `response` object, as returned
    conversation: list[dict[str, Any]]  # input + output items, in order (instructions excluded)


def tenant_scope(tenant: str) -> str:
    """A subject-safe, fixed-length token per tenant (tenant names need not be valid tokens)."""
    return "t-" + hashlib.sha256(b"kvmesh.responses.v1\x00" + tenant.encode()).hexdigest()[:32]


class ResponseStore(EntryStore[StoredResponse]):
    """Tenant-scoped access to the bucket (shared/ingress/core/entry_store.py)."""

    __slots__ = ()

    def __init__(self, js: JetStreamContext) -> None:
        super().__init__(js, RESPONSES, StoredResponse)

    @staticmethod
    def _key(tenant: str, response_id: str) -> str | None:
        try:
            return subjects.response_key(tenant_scope(tenant), response_id)
        except ValueError:  # not a token: no such response
            return None

    async def put(self, entry: StoredResponse) -> None:
        key = self._key(entry.tenant, entry.id)
        if key is None:
            raise ValueError(f"not a response id: {entry.id!r}")
        await self._put(key, entry)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._get(tenant, self._key(tenant, response_id))

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget a response; False if the tenant has no such (live) response."""
        return await self._delete(tenant, self._key(tenant, response_id))
