"""A handed-off prompt's KV on its way to the decode worker while the prompt is still being prefilled.

Chunked prefill takes a long prompt in several engine steps. After each one the
engine hands over the full blocks that step cached, as views of its pool held
under a lease (`RequestSpec.on_cached`). A `PrefillStream` encodes them
straight into this worker's L2 (one copy: pool -> shared memory), a window at a
time so token events and other requests get the event loop in between. Then it
tells the decode worker to pull the chain so far into its own pool and hold it
there for the `DecodeJob`: a `Retain` with `fetch` and `owner` on the decode
worker's pull subject (core NATS), applied as a session prefetch is
(shared/serving/worker_commands.py). When the first token is out, most of the
prompt is already in decode's pool; the handoff itself moves only what the
last step cached.

All of it is best effort. A block that did not make it (L2 full of pins, a
pull that lost a race with the DecodeJob, an evicted pin) is fetched or
recomputed when the DecodeJob resolves: the same tokens either way.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvmesh.bus.publish import Publisher
from kvmesh.engine.kv_block import KVBlock
from kvmesh.eviction.messages import Retain
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.serving.worker_tiers import WorkerTiers

log = get_logger(__name__)

WINDOW_BLOCKS = 16  # blocks encoded between two yields to the event loop


@dataclass
class PrefillStream:
    tiers: WorkerTiers
    publisher: Publisher
    request_id: str  # names the pull commands (their message ids)
    hashes: list[bytes]  # the prompt's chain of full blocks, position 0 first
    tenant_salt: str
    owner: str  # this worker: where the decode worker pulls from
    decode_worker: str
    hold_s: float  # how long the decode worker keeps what it pulled
    session_id: str | None = None
    stored: int = 0  # leading blocks of the chain this stream put into L2
    _pending: list[KVBlock] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _closing: bool = False
    _task: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, blocks: list[KVBlock]) -> None:
        """The next leading blocks of the chain (pool views under the engine's lease); on the event loop."""
        self._pending += blocks
        self._wake.set()

    async def close(self) -> None:
        """Store and announce what was added; after this the caller may release the engine's lease."""
        self._closing = True
        self._wake.set()
        assert self._task is not None
        try:
            await self._task
        except Exception as exc:  # noqa: BLE001 - best effort: the DecodeJob's resolve covers what is missing
            log.warning("prefill stream failed", request_id=self.request_id, error=repr(exc))

    async def _run(self) -> None:
        with self.tiers.storing_chain():  # until closed: the L3 uploads wait (shared/tiers/upload_queue.py)
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._pending:
                    blocks, self._pending = self._pending, []
                    if await self._store(blocks):
                        await self._pull()
                elif self._closing:
                    return

    async def _store(self, blocks: list[KVBlock]) -> bool:
        """Register `blocks` (the chain's next run) in L2 window by window; whether the chain grew."""
        before = self.stored
        for at in range(0, len(blocks), WINDOW_BLOCKS):
            if at:
                await asyncio.sleep(0)  # token events and other requests between two windows
            part = blocks[at:at + WINDOW_BLOCKS]
            end = self.stored + len(part)
            if self.hashes[self.stored:end] != [kb.block_hash for kb in part]:
                log.warning("prefill stream out of order", request_id=self.request_id, at=self.stored)
                return self.stored > before
            handles, _ = self.tiers.register(self.hashes[:end], part, self.tenant_salt, self.session_id)
            if len(handles) < end:  # L2 took only part of it: the decode worker could pull only that far
                self.stored = len(handles)
                return self.stored > before
            self.stored = end
        return self.stored > before

    async def _pull(self) -> None:
        """Ask the decode worker to bring the stored chain into its pool and hold it for the DecodeJob."""
        cmd = Retain(hashes=[h.hex() for h in self.hashes[:self.stored]], until=time.time() + self.hold_s, fetch=True,
                     tenant_salt=self.tenant_salt, session_id=self.session_id or "", owner=self.owner)
        await self.publisher.send(subjects.pull(self.decode_worker), cmd, msg_id=f"{self.request_id}:pull:{self.stored}")
