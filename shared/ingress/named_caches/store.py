"""Named-cache metadata in the JetStream KV bucket `named_caches` (key = cache id, TTL per entry).

An entry holds what a request that names the cache needs to rebuild its
prefix (the flat messages and tools), who owns it (tenant) and when it
expires. The KV entry carries the cache's TTL, so NATS forgets it on its own;
reads also check `expires_at`, so an entry is never served past its time.
The bucket lives in the JetStream file store: it survives a restart of the
stack, as the cache's KV blocks in L3 do.
"""

from __future__ import annotations

import time
from typing import Any

from kvmesh.bus.kv_bucket import open_bucket
from kvmesh.protocol import subjects
from kvmesh.protocol.base import Message
from kvmesh.protocol.streams import NAMED_CACHES
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError


class NamedCache(Message):
    id: str
    tenant: str
    model: str
    display_name: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    prompt_tokens: int
    prefix_sha256: str  # of the prompt ids, to tell a changed tokenizer or template
    created_at: float
    expires_at: float
    cached_tokens: int = 0  # already cached when it was created
    cache_created_tokens: int = 0

    def live(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires_at

    def public(self) -> dict[str, Any]:
        """The API object (content is not echoed back)."""
        return {"id": self.id, "object": "cache", "model": self.model, "display_name": self.display_name,
                "created_at": int(self.created_at), "expires_at": int(self.expires_at),
                "ttl_seconds": round(self.expires_at - self.created_at),
                "usage": {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                          "cache_creation_input_tokens": self.cache_created_tokens}}


class NamedCacheStore:
    """Tenant-scoped access to the bucket; `get` answers None for another tenant's or an expired cache."""

    __slots__ = ("js", "_kv")

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv = None

    async def _bucket(self):
        if self._kv is None:
            self._kv = await open_bucket(self.js, NAMED_CACHES)
        return self._kv

    async def put(self, cache: NamedCache) -> None:
        await self._bucket()
        ttl = max(1.0, cache.expires_at - time.time())
        await self.js.publish(subjects.named_cache_key(cache.id), cache.to_bytes(), msg_ttl=ttl)

    async def get(self, tenant: str, cache_id: str) -> NamedCache | None:
        try:
            subjects.token(cache_id)
        except ValueError:
            return None
        kv = await self._bucket()
        try:
            entry = await kv.get(cache_id)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        cache = NamedCache.from_bytes(entry.value)
        return cache if cache.tenant == tenant and cache.live() else None

    async def list(self, tenant: str) -> list[NamedCache]:
        kv = await self._bucket()
        try:
            keys = await kv.keys()
        except NoKeysError:
            return []
        found = [await self.get(tenant, key) for key in keys]
        return sorted((c for c in found if c is not None), key=lambda c: c.created_at)

    async def delete(self, tenant: str, cache_id: str) -> bool:
        if await self.get(tenant, cache_id) is None:
            return False
        kv = await self._bucket()
        await kv.delete(cache_id)
        return True
