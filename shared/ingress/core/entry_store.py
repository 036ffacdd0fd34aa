"""Entries a tenant owns in a JetStream KV bucket, each kept for its own time (stored responses, named caches).

An entry names its tenant and `expires_at`. Every write carries the time left as the message's TTL, so
NATS forgets the entry on its own, and reads check `expires_at` too, so an entry is never served past
its time: `get` answers None for another tenant's, an unknown or an expired entry. The bucket is in the
JetStream file store, so entries survive a restart of the stack. A store names the key of an entry
(None: not a valid key, so there is no such entry).
"""

from __future__ import annotations

import time
from typing import Generic, TypeVar

from kvmesh.bus.kv_bucket import open_bucket
from kvmesh.protocol.base import Message
from kvmesh.protocol.streams import BucketSpec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue


class OwnedEntry(Message):
    tenant: str
    expires_at: float

    def live(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires_at


E = TypeVar("E", bound=OwnedEntry)


class EntryStore(Generic[E]):
    __slots__ = ("js", "_spec", "_model", "_kv")

    def __init__(self, js: JetStreamContext, spec: BucketSpec, model: type[E]) -> None:
        self.js, self._spec, self._model = js, spec, model
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await open_bucket(self.js, self._spec)
        return self._kv

    async def _put(self, key: str, entry: E) -> None:
        await self._bucket()  # declared if the stack predates it
        ttl = max(1.0, entry.expires_at - time.time())
        await self.js.publish(f"$KV.{self._spec.name}.{key}", entry.to_bytes(), msg_ttl=ttl)

    async def _get(self, tenant: str, key: str | None) -> E | None:
        if key is None:
            return None
        kv = await self._bucket()
        try:
            found = await kv.get(key)
        except KeyNotFoundError:
            return None
        if not found.value:
            return None
        entry = self._model.from_bytes(found.value)
        return entry if entry.tenant == tenant and entry.live() else None

    async def _delete(self, tenant: str, key: str | None) -> bool:
        """Forget an entry; False if the tenant has no such (live) entry."""
        if key is None or await self._get(tenant, key) is None:
            return False
        await (await self._bucket()).delete(key)
        return True

    async def _keys(self) -> list[str]:
        try:
            return await (await self._bucket()).keys()
        except NoKeysError:
            return []
