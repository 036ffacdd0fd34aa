"""Peer fetch over NATS: request/reply with the block streamed in chunks below max_payload.

A request to `peer_subject(worker)` carries the 32-byte block hash; the owner
publishes the encoded block to the reply inbox as `count` messages, each
prefixed by (index u32, count u32). count 0 means "not here". NATS keeps
per-connection order, and the client still places chunks by index. A worker
that is gone answers at once through the server's no-responders status.
"""

from __future__ import annotations

import asyncio
import struct

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.tiers.block_format import StoredBlock, decode_or_miss
from shared.tiers.l2_host import HostTier
from shared.tiers.miss import Miss, MissCounters, MissReason, Tier

_PREFIX = struct.Struct("<II")


def peer_subject(worker_id: str) -> str:
    return f"kvmesh.peer.{worker_id}.block"


class NatsPeerServer:
    """Answers block requests for one worker's L2."""

    def __init__(self, nc: NATS, tier: HostTier, worker_id: str, chunk_bytes: int = 1 << 20) -> None:
        self.nc = nc
        self.tier = tier
        self.worker_id = worker_id
        self.chunk_bytes = min(chunk_bytes, nc.max_payload - _PREFIX.size - 1024)
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(peer_subject(self.worker_id), cb=self._on_request)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            return
        buf = self.tier.get_encoded(bytes(msg.data[:32])) if len(msg.data) >= 32 else None
        if buf is None or isinstance(buf, Miss):
            await self.nc.publish(msg.reply, _PREFIX.pack(0, 0))
            return
        size, step = len(buf), self.chunk_bytes
        count = max(1, -(-size // step))
        for i in range(count):
            await self.nc.publish(msg.reply, _PREFIX.pack(i, count) + bytes(buf[i * step:(i + 1) * step]))


class NatsPeerClient:
    """Fetches blocks from peers over one multiplexed inbox subscription."""

    def __init__(self, nc: NATS, fingerprint: str, counters: MissCounters, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.fingerprint = fingerprint
        self.counters = counters
        self.timeout_s = timeout_s
        self._prefix = nc.new_inbox()
        self._pending: dict[str, asyncio.Queue] = {}
        self._next = 0
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self._prefix + ".*", cb=self._on_reply)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_reply(self, msg: Msg) -> None:
        queue = self._pending.get(msg.subject)
        if queue is not None:
            queue.put_nowait(msg.data)

    async def fetch(self, worker_id: str, block_hash: bytes) -> StoredBlock | Miss:
        self._next += 1
        inbox = f"{self._prefix}.{self._next}"
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[inbox] = queue
        try:
            await self.nc.publish(peer_subject(worker_id), block_hash, reply=inbox)
            parts = await asyncio.wait_for(self._collect(queue), self.timeout_s)
        except (TimeoutError, ConnectionError) as exc:
            return self.counters.record(Miss(Tier.PEER, MissReason.UNAVAILABLE, f"{worker_id}: {exc!r}"))
        finally:
            del self._pending[inbox]
        if parts is None:
            return self.counters.record(Miss(Tier.PEER, MissReason.NOT_FOUND, worker_id))
        buf = parts[0] if len(parts) == 1 else b"".join(parts)
        return decode_or_miss(buf, self.fingerprint, block_hash, Tier.PEER, self.counters)

    @staticmethod
    async def _collect(queue: asyncio.Queue) -> list[bytes] | None:
        parts: list[bytes] = []
        got, count = 0, 1
        while got < count:
            data = await queue.get()
            if len(data) < _PREFIX.size:  # the server's "no responders" status: the peer is gone
                raise ConnectionError("no responders")
            index, count = _PREFIX.unpack_from(data, 0)
            if count == 0:
                return None
            if not parts:
                parts = [b""] * count
            parts[index] = memoryview(data)[_PREFIX.size:]
            got += 1
        return parts
