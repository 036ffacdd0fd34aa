"""Peer fetch over HTTP: a worker serves its L2 blocks; others GET them by hash.

The route returns the encoded block as stored (the receiver verifies it);
404 when the block is not in this worker's L2. The client checks fingerprint,
hash and checksum before handing anything on, so a bad peer is a counted miss.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import APIRouter, FastAPI, Response
from kvmesh.net import free_port
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.block_format import StoredBlock, decode_or_miss
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.miss import Miss, MissCounters, MissReason

BLOCK_ROUTE = "/kv/blocks/{block_hash}"


def peer_router(tier: HostTier) -> APIRouter:
    """Mount on a worker's side HTTP app: GET /kv/blocks/{hex hash} -> encoded block."""
    router = APIRouter()

    @router.get(BLOCK_ROUTE)
    async def get_block(block_hash: str) -> Response:
        try:
            key = bytes.fromhex(block_hash)
        except ValueError:
            return Response(status_code=400, content=b"block hash must be hex")
        buf = tier.get_encoded(key)
        if isinstance(buf, Miss):
            return Response(status_code=404)
        return Response(content=buf, media_type="application/octet-stream")

    return router


class HttpPeerClient:
    """Fetches blocks from peers; `base_url(worker_id)` says where a worker listens."""

    def __init__(self, base_url: Callable[[str], str], fingerprint: str, counters: MissCounters,
                 timeout_s: float = 5.0, max_connections: int = 32) -> None:
        self.base_url = base_url
        self.fingerprint = fingerprint
        self.counters = counters
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(timeout=timeout_s, limits=limits)

    async def fetch(self, worker_id: str, block_hash: bytes) -> StoredBlock | Miss:
        url = self.base_url(worker_id) + BLOCK_ROUTE.format(block_hash=block_hash.hex())
        try:
            resp = await self._http.get(url)
        except httpx.HTTPError as exc:
            return self.counters.record(Miss(Tier.PEER, MissReason.UNAVAILABLE, f"{worker_id}: {exc!r}"))
        if resp.status_code == 404:
            return self.counters.record(Miss(Tier.PEER, MissReason.NOT_FOUND, worker_id))
        if resp.status_code != 200:
            return self.counters.record(Miss(Tier.PEER, MissReason.UNAVAILABLE, f"{worker_id}: HTTP {resp.status_code}"))
        return decode_or_miss(resp.content, self.fingerprint, block_hash, Tier.PEER, self.counters)

    async def close(self) -> None:
        await self._http.aclose()


@asynccontextmanager
async def serve_in_loop(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Run `app` with uvicorn on this event loop (tests, benches); yields its base URL."""
    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError(f"peer HTTP server on {host}:{port} exited at start")
            await asyncio.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await task
