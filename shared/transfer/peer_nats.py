"""Peer fetch over NATS: one request names a chain of blocks; the owner streams them back.

The client publishes the hashes (shared/transfer/pieces.py) to
`peer_fetch_subject(owner)` with a reply inbox of its own. The owner answers
with messages of up to the server's `max_payload` holding pieces of the
blocks, in request order, made of views of its L2 (no per-block round
trip, no copy before the socket), and keeps at most the client's window of bytes in
flight: the client credits what it has taken in on `peer_credit_subject`, so
a slow client cannot make the bus buffer without bound (credit_window.py).
A block not in L2 answers "not here" for that block alone. A worker that is
gone answers at once through the server's no-responders status; a peer that
stops sending for `timeout_s` ends the transfer, and every block not yet
complete becomes an UNAVAILABLE miss (blocks already verified are kept).
The client verifies every block as it completes, while later ones travel.
Requests, credits and replies travel on a lean wire to the same server
(shared/transfer/nats_wire.py: frames sent from views of L2, payloads
received into their own buffers) where the server allows one, else on the
service's nats-py connection; the protocol is the same on both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvmesh.aio import wait_event
from kvmesh.log import get_logger
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.block_format import StoredBlock, decode_or_miss
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.miss import Miss, MissCounters, MissReason
from kvmesh.transfer.credit_window import CreditWindow, TransferCancelled
from kvmesh.transfer.links import Link, NatsPyLink, open_link
from kvmesh.transfer.nats_wire import NatsWire
from kvmesh.transfer.pieces import (
    BlockAssembly,
    decode_credit,
    decode_request,
    encode_credit,
    encode_request,
    max_hashes,
    pack_messages,
)
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

log = get_logger(__name__)


def peer_fetch_subject(worker_id: str) -> str:
    return f"kvmesh.peer.{worker_id}.fetch"


def peer_credit_subject(worker_id: str) -> str:
    return f"kvmesh.peer.{worker_id}.credit"


class NatsPeerServer:
    """Streams blocks of one worker's L2 to whoever asks; runs on the worker's event loop (L2's owner).

    `chunk_bytes` caps a reply message below `nc.max_payload` (tests use it to force splits);
    a transfer whose client sends no credit for `stall_s` is dropped.
    """

    def __init__(self, nc: NATS, tier: HostTier, worker_id: str, chunk_bytes: int | None = None,
                 stall_s: float = 10.0, max_window_bytes: int = 64 << 20, use_wire: bool = True) -> None:
        self.nc = nc
        self.tier = tier
        self.worker_id = worker_id
        self.chunk_bytes = chunk_bytes
        self.stall_s = stall_s
        self.max_window_bytes = max_window_bytes
        self.use_wire = use_wire
        self._subs: list = []
        self._windows: dict[str, CreditWindow] = {}  # reply inbox -> its transfer's flow control
        self._tasks: set[asyncio.Task] = set()
        self._link: Link | None = None  # where replies go out; requests and credits come in on `nc`
        self._link_lock = asyncio.Lock()

    def message_bytes(self, link: Link) -> int:
        return min(self.chunk_bytes or link.max_payload, link.max_payload, self.nc.max_payload)

    async def start(self) -> None:
        self._subs = [await self.nc.subscribe(peer_fetch_subject(self.worker_id), cb=self._on_request),
                      await self.nc.subscribe(peer_credit_subject(self.worker_id), cb=self._on_credit)]

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._link is not None:
            await self._link.close()
            self._link = None

    async def _reply_link(self) -> Link:
        """The open reply link, opened on first use and again after a wire broke."""
        async with self._link_lock:
            if self._link is None or self._link.closed.is_set():
                self._link = await open_link(self.nc, f"kvmesh-peer-{self.worker_id}", self.use_wire)
            return self._link

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply or msg.reply in self._windows:
            return
        try:
            hashes, window = decode_request(msg.data)
        except ValueError as exc:
            log.warning("bad peer fetch request", error=str(exc))
            return
        flow = self._windows[msg.reply] = CreditWindow(min(window, self.max_window_bytes) or self.max_window_bytes)
        task = asyncio.get_running_loop().create_task(self._stream(msg.reply, hashes, flow))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_credit(self, msg: Msg) -> None:
        try:
            received, cancel, reply = decode_credit(msg.data)
        except ValueError:  # a malformed credit is dropped; the transfer stalls out if it mattered
            return
        flow = self._windows.get(reply)
        if flow is not None:
            flow.credit(received, cancel)

    async def _stream(self, reply: str, hashes: list[bytes], flow: CreditWindow) -> None:
        try:
            link = await self._reply_link()  # one connection per transfer: NATS keeps its order
            for parts in pack_messages(self._blocks(hashes), self.message_bytes(link)):
                await flow.reserve(sum(len(p) for p in parts), self.stall_s)
                await link.publish(reply, parts)
        except TimeoutError:
            log.info("peer transfer dropped: no credit", stall_s=self.stall_s, blocks=len(hashes), sent=flow.sent)
        except TransferCancelled:
            pass
        except (NatsError, ConnectionError) as exc:
            log.info("peer transfer failed", error=repr(exc))
        finally:
            self._windows.pop(reply, None)
            if isinstance(self._link, NatsPyLink) and self._link.temporary:
                self._link = None  # the next transfer tries for a wire again

    def _blocks(self, hashes: list[bytes]) -> Iterator[tuple[int, memoryview | None]]:
        """Views of the stored bytes, looked up as the stream reaches them (eviction meanwhile = not here)."""
        for i, h in enumerate(hashes):
            buf = self.tier.get_encoded(h)
            yield i, None if isinstance(buf, Miss) else buf


@dataclass(slots=True)
class _Transfer:
    link: Link
    worker_id: str
    hashes: list[bytes]
    assembly: BlockAssembly
    results: list  # StoredBlock | Miss | None (not yet)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    received: int = 0  # reply bytes taken in (the credit)
    error: str = ""  # why it ended early; "" while fine


class NatsPeerClient:
    """Fetches blocks from peers over one multiplexed inbox subscription.

    `timeout_s` bounds the wait for each next message of a transfer (a 2 GiB chain moves, a
    dead or stuck peer does not hold a fetch longer than this). At most `max_transfers` run at
    once, each with `window_bytes` in flight (default two messages): together under what
    nats-server buffers for one connection before cutting it as a slow consumer.
    """

    def __init__(self, nc: NATS, fingerprint: str, counters: MissCounters, timeout_s: float = 5.0,
                 window_bytes: int | None = None, max_transfers: int = 3, use_wire: bool = True) -> None:
        self.nc = nc
        self.fingerprint = fingerprint
        self.counters = counters
        self.timeout_s = timeout_s
        self.window_bytes = window_bytes
        self.use_wire = use_wire
        self._slots = asyncio.Semaphore(max_transfers)
        self._prefix = nc.new_inbox()
        self._pending: dict[str, _Transfer] = {}
        self._next = 0
        self._link: Link | None = None  # requests and credits go out, replies come in, all on this one
        self._link_lock = asyncio.Lock()

    async def start(self) -> None:
        await self._open_link()

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()
            self._link = None

    async def _open_link(self) -> Link:
        """The open link with the inbox subscribed; a broken wire is replaced (its transfers fail)."""
        async with self._link_lock:
            if self._link is None or self._link.closed.is_set():
                link = await open_link(self.nc, "kvmesh-peer-client", self.use_wire)
                if isinstance(link, NatsWire):
                    link.on_close = lambda: self._lost(link)
                await link.subscribe(self._prefix + ".*", self._on_reply)
                self._link = link
            return self._link

    async def _drop_if_temporary(self, link: Link) -> None:
        """A stand-in nats-py link is let go once idle, so the next transfer tries for a wire again."""
        if (isinstance(link, NatsPyLink) and link.temporary and self._link is link
                and not any(t.link is link for t in self._pending.values())):
            self._link = None
            await link.close()

    def _lost(self, link: Link) -> None:
        """A wire broke: its transfers end now (their complete blocks stay), not at their timeout."""
        for t in self._pending.values():
            if t.link is link and not t.error:
                t.error = "data connection lost"
                t.progress.set()

    async def fetch(self, worker_id: str, block_hash: bytes) -> StoredBlock | Miss:
        return (await self.fetch_many(worker_id, [block_hash]))[0]

    async def fetch_many(self, worker_id: str, hashes: Sequence[bytes]) -> list[StoredBlock | Miss]:
        """One entry per hash, in order: the verified block or a counted miss; never raises for the peer."""
        hashes = list(hashes)
        step = max_hashes(self.nc.max_payload)
        out: list[StoredBlock | Miss] = []
        for start in range(0, len(hashes), step):  # a request must fit in one message too
            out += await self._transfer(worker_id, hashes[start:start + step])
        return out

    async def _transfer(self, worker_id: str, hashes: list[bytes]) -> list[StoredBlock | Miss]:
        async with self._slots:
            self._next += 1
            inbox = f"{self._prefix}.{self._next}"
            try:
                link = await self._open_link()
            except (NatsError, ConnectionError) as exc:
                return [self.counters.record(Miss(Tier.PEER, MissReason.UNAVAILABLE, f"{worker_id}: {exc!r}"))
                        for _ in hashes]
            t = _Transfer(link, worker_id, hashes, BlockAssembly(len(hashes)), [None] * len(hashes))
            self._pending[inbox] = t
            window = self.window_bytes or 2 * link.max_payload
            try:
                await link.publish(peer_fetch_subject(worker_id), [encode_request(hashes, window)], reply=inbox)
                while not t.assembly.done and not t.error:
                    t.progress.clear()
                    if not await wait_event(t.progress, self.timeout_s):
                        t.error = f"no reply for {self.timeout_s}s"
            except TimeoutError:  # publishing the request timed out
                t.error = f"no reply for {self.timeout_s}s"
            except (NatsError, ConnectionError) as exc:
                t.error = repr(exc)
            finally:
                del self._pending[inbox]
            if t.error and t.error not in ("no responders", "data connection lost"):
                await self._cancel(link, worker_id, inbox, t.received)
            await self._drop_if_temporary(link)
        detail = f"{worker_id}: {t.error}"
        return [r if r is not None else self.counters.record(Miss(Tier.PEER, MissReason.UNAVAILABLE, detail))
                for r in t.results]

    async def _on_reply(self, subject: str, payload: bytearray | None) -> None:
        t = self._pending.get(subject)
        if t is None or t.error:
            return
        if payload is None:  # 503: nobody serves that worker's subject (it is gone)
            t.error = "no responders"
            t.progress.set()
            return
        try:
            completed = t.assembly.add(payload)
        except ValueError as exc:
            t.error = f"bad reply: {exc}"
            t.progress.set()
            return
        t.received += len(payload)
        if not t.assembly.done:
            try:
                await t.link.publish(peer_credit_subject(t.worker_id), [encode_credit(t.received, subject)])
            except (NatsError, ConnectionError) as exc:
                t.error = repr(exc)
        for i in completed:
            t.results[i] = self._verified(t, i)
        t.progress.set()

    def _verified(self, t: _Transfer, i: int) -> StoredBlock | Miss:
        if t.assembly.missing[i]:
            return self.counters.record(Miss(Tier.PEER, MissReason.NOT_FOUND, t.worker_id))
        return decode_or_miss(t.assembly.blocks[i], self.fingerprint, t.hashes[i], Tier.PEER, self.counters)

    @staticmethod
    async def _cancel(link: Link, worker_id: str, inbox: str, received: int) -> None:
        """Tell the owner to stop streaming a transfer we gave up on (best effort)."""
        try:
            await link.publish(peer_credit_subject(worker_id), [encode_credit(received, inbox, cancel=True)])
        except (NatsError, ConnectionError):
            pass
