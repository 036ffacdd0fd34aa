"""The named-cache metadata store on a real JetStream KV bucket: tenant scope, expiry, delete."""

from __future__ import annotations

import asyncio
import time

import nats
from kvmesh.ingress.named_caches.store import NamedCache, NamedCacheStore
from kvmesh.stack.servers import NatsServer


def entry(cache_id: str, tenant: str, expires_in: float) -> NamedCache:
    now = time.time()
    return NamedCache(id=cache_id, tenant=tenant, model="m", messages=[{"role": "system", "content": "s"}],
                      prompt_tokens=5, prefix_sha256="0" * 64, created_at=now - 1, expires_at=now + expires_in)


async def test_scope_expiry_delete(fresh_nats_server: NatsServer) -> None:
    nc = await nats.connect(fresh_nats_server.url)
    try:
        store = NamedCacheStore(nc.jetstream())  # declares the bucket itself on a server that lacks it
        assert await store.list("a") == []
        await store.put(entry("cache_live", "a", 600))
        await store.put(entry("cache_other", "b", 600))
        await store.put(entry("cache_stale", "a", 1.2))  # the KV entry's TTL is the cache's: NATS drops it
        assert (await store.get("a", "cache_live")).messages == [{"role": "system", "content": "s"}]
        assert await store.get("b", "cache_live") is None
        assert await store.get("a", "bad.id*") is None
        assert [c.id for c in await store.list("a")] == ["cache_live", "cache_stale"]
        await asyncio.sleep(1.3)
        assert await store.get("a", "cache_stale") is None  # past expires_at: never served
        assert [c.id for c in await store.list("a")] == ["cache_live"]
        assert not await store.delete("b", "cache_live")
        assert await store.delete("a", "cache_live")
        assert await store.get("a", "cache_live") is None
        assert [c.id for c in await store.list("b")] == ["cache_other"]
    finally:
        await nc.close()
