"""State dumps: a worker's whole L1/L2 state, requested by the index after a sequence gap.

The request goes to `subjects.kv_dump(worker)` with a reply inbox; the worker
answers with `chunks` `StateDumpChunk` messages on that inbox, each under the
connection's max_payload, all cut from one consistent state. The caller
collects them (any order) until it has all, or fails with `DumpError` after
its timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
from kvmesh.kv_events.events import StateDumpChunk, StateDumpRequest
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.base import ProtocolError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = get_logger(__name__)

HEX_HASH_BYTES = 70  # one hex SHA-256 in a JSON list: 64 chars, quotes, comma, slack
_ENVELOPE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class WorkerState:
    """A worker's L1/L2 hashes (hex) as of event `seq` of `epoch`."""

    worker: str
    epoch: int
    seq: int
    l1: list[str]
    l2: list[str]


class DumpError(RuntimeError):
    """No complete dump arrived (worker gone, timeout, or unreadable chunk)."""


def hashes_per_chunk(max_payload: int) -> int:
    return max(1, (max_payload - _ENVELOPE_BYTES) // HEX_HASH_BYTES)


def chunk_state(state: WorkerState, max_hashes: int) -> list[StateDumpChunk]:
    """Cut `state` into chunks of at most `max_hashes` hashes (L1 first, then L2)."""
    items = [(1, h) for h in state.l1] + [(2, h) for h in state.l2]
    parts = [items[i : i + max_hashes] for i in range(0, len(items), max_hashes)] or [[]]
    return [
        StateDumpChunk(worker=state.worker, epoch=state.epoch, seq=state.seq, chunk=i, chunks=len(parts),
                       l1=[h for t, h in part if t == 1], l2=[h for t, h in part if t == 2])
        for i, part in enumerate(parts)
    ]


async def serve_dump(nc: NATS, worker_id: str, state: Callable[[], WorkerState]) -> Subscription:
    """Answer dump requests for `worker_id` from `state()` (called once per request)."""

    async def on_request(msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            req = StateDumpRequest.from_bytes(msg.data)
        except ProtocolError as exc:
            log.warning("bad dump request", worker_id=worker_id, error=str(exc))
            return
        limit = min(req.max_hashes_per_chunk, hashes_per_chunk(nc.max_payload))
        for chunk in chunk_state(state(), limit):
            await nc.publish(msg.reply, chunk.to_bytes())

    return await nc.subscribe(subjects.kv_dump(worker_id), cb=on_request)


async def fetch_dump(nc: NATS, worker_id: str, timeout_s: float) -> WorkerState:
    """Ask `worker_id` for its state and reassemble the chunks; raises DumpError."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    parts: dict[int, StateDumpChunk] = {}
    try:
        req = StateDumpRequest(max_hashes_per_chunk=hashes_per_chunk(nc.max_payload))
        await nc.publish(subjects.kv_dump(worker_id), req.to_bytes(), reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                msg = await sub.next_msg(timeout=max(0.001, deadline - loop.time()))
            except nats.errors.TimeoutError as exc:
                raise DumpError(f"state dump of {worker_id}: {len(parts)} chunks after {timeout_s}s") from exc
            if not msg.data and (msg.headers or {}).get("Status") == "503":
                raise DumpError(f"state dump of {worker_id}: no responders (worker gone?)")
            try:
                chunk = StateDumpChunk.from_bytes(msg.data)
            except ProtocolError as exc:
                raise DumpError(f"state dump of {worker_id}: {exc}") from exc
            if chunk.chunk >= chunk.chunks or (parts and chunk.chunks != next(iter(parts.values())).chunks):
                raise DumpError(f"state dump of {worker_id}: inconsistent chunk numbering")
            parts[chunk.chunk] = chunk
            if len(parts) == chunk.chunks:
                break
    finally:
        await sub.unsubscribe()
    first = parts[0]
    if any((p.epoch, p.seq) != (first.epoch, first.seq) for p in parts.values()):
        raise DumpError(f"state dump of {worker_id}: chunks of different states")
    ordered = [parts[i] for i in range(first.chunks)]
    return WorkerState(worker_id, first.epoch, first.seq,
                       [h for p in ordered for h in p.l1], [h for p in ordered for h in p.l2])
