"""Named-cache metadata in the JetStream KV bucket `named_caches` (key = cache id, TTL per entry).

An entry holds what a request that names the cache needs to rebuild its
prefix (the flat messages and tools), who owns it (tenant) and when it
expires; it is kept for the cache's TTL (shared/ingress/core/entry_store.py),
and survives a restart of the stack, as the cache's KV blocks in L3 do.
"""

from __future__ import annotations

from typing import Any

from kvmesh.ingress.core.entry_store import EntryStore, OwnedEntry
from kvmesh.protocol import subjects
from kvmesh.protocol.streams import NAMED_CACHES
from nats.js import JetStreamContext


class NamedCache(OwnedEntry):
    id: str
    model: str
    display_name: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    prompt_tokens: int
    prefix_sha256: str  # of the prompt ids, to tell a changed tokenizer or template
    created_at: float
    cached_tokens: int = 0  # already cached when it was created
    cache_created_tokens: int = 0

    def public(self) -> dict[str, Any]:
        """The API object (content is not echoed back)."""
        return {"id": self.id, "object": "cache", "model": self.model, "display_name": self.display_name,
                "created_at": int(self.created_at), "expires_at": int(self.expires_at),
                "ttl_seconds": round(self.expires_at - self.created_at),
                "usage": {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                          "cache_creation_input_tokens": self.cache_created_tokens}}


class NamedCacheStore(EntryStore[NamedCache]):
    """Tenant-scoped access to the bucket; `get` answers None for another tenant's or an expired cache."""

    __slots__ = ()

    def __init__(self, js: JetStreamContext) -> None:
        super().__init__(js, NAMED_CACHES, NamedCache)

    @staticmethod
    def _key(cache_id: str) -> str | None:
        try:
            return subjects.token(cache_id)
        except ValueError:  # not a token: no such cache
            return None

    async def put(self, cache: NamedCache) -> None:
        key = self._key(cache.id)
        if key is None:
            raise ValueError(f"not a cache id: {cache.id!r}")
        await self._put(key, cache)

    async def get(self, tenant: str, cache_id: str) -> NamedCache | None:
        return await self._get(tenant, self._key(cache_id))

    async def list(self, tenant: str) -> list[NamedCache]:
        found = [await self.get(tenant, key) for key in await self._keys()]
        return sorted((c for c in found if c is not None), key=lambda c: c.created_at)

    async def delete(self, tenant: str, cache_id: str) -> bool:
        return await self._delete(tenant, self._key(cache_id))
