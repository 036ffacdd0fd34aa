"""A lean second NATS connection for bulk bytes: frames leave from memoryviews, payloads land in buffers.

nats-py reads in 32 KiB pieces into a growing parse buffer and slices each
message out twice, and joins a PUB frame before writing it: measured here
it spends 2.4-3.2 CPU seconds per GB received, which caps peer fetch near
0.3 GB/s on one core. Peer fetch's bulk side uses this connection instead:
`publish` sends a frame with `sendmsg` straight from views of L2 (no copy
in user space) and each MSG payload is received with `recv_into` into a
buffer of its own (one copy, kernel to user), which the receiver then
decodes in place.

It speaks the part of the protocol this needs: INFO, CONNECT, PING/PONG,
SUB, PUB, MSG, HMSG (as a status: 503 = no responders; other headers are
dropped), +OK/-ERR. `connect` raises `WireUnsupported` for a server that
requires TLS or credentials it was not given, so the caller keeps to
nats-py there. It never reconnects: when the socket fails, `closed` is set,
`on_close` runs, and the owner opens a new one for the next transfer.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlparse

_CRLF = b"\r\n"
_MAX_LINE = 4096  # nats-server's default max control line
_STAGING = 64 * 1024
_MAX_IOV = 512  # buffers per sendmsg, under the kernel's IOV_MAX (1024)

Handler = Callable[[str, bytearray | None], Awaitable[None]]  # payload None: a 503 no-responders status


class WireUnsupported(Exception):
    """The server wants something this connection does not do (TLS, auth): use nats-py."""


class NatsWire:
    def __init__(self, sock: socket.socket, info: dict) -> None:
        self.sock = sock
        self.max_payload: int = int(info.get("max_payload", 1 << 20))
        self.closed = asyncio.Event()
        self.error = ""
        self.on_close: Callable[[], None] | None = None
        self._handlers: dict[int, Handler] = {}
        self._write = asyncio.Lock()  # one frame at a time: frames must not interleave
        self._pongs: list[asyncio.Future] = []
        self._staging = bytearray(_STAGING)
        self._have = 0  # bytes of _staging holding unread protocol
        self._reader: asyncio.Task | None = None

    @classmethod
    async def connect(cls, url: str, name: str = "kvmesh-wire", timeout_s: float = 5.0) -> NatsWire:
        """Open, handshake (CONNECT + PING/PONG) and start reading; WireUnsupported or OSError on failure."""
        parsed = urlparse(url if "://" in url else f"nats://{url}")
        if parsed.scheme not in ("nats", ""):
            raise WireUnsupported(f"scheme {parsed.scheme!r}")
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in (parsed.hostname or "") else socket.AF_INET)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (parsed.hostname, parsed.port or 4222)), timeout_s)
            wire = cls(sock, {})
            line = await asyncio.wait_for(wire._read_line(), timeout_s)
            if not line.startswith(b"INFO "):
                raise WireUnsupported(f"server greeted with {line[:40]!r}")
            info = json.loads(line[5:])
            if info.get("tls_required") or (info.get("auth_required") and not parsed.username):
                raise WireUnsupported("server requires TLS or auth")
            wire.max_payload = int(info.get("max_payload", wire.max_payload))
            options = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True, "protocol": 1,
                       "name": name, "lang": "python-kvmesh-wire"}
            if parsed.username:
                options.update(user=parsed.username, **{"pass": parsed.password or ""})
            await loop.sock_sendall(sock, b"CONNECT " + json.dumps(options).encode() + _CRLF)
            wire._reader = loop.create_task(wire._read_loop())
            await asyncio.wait_for(wire.flush(), timeout_s)
            return wire
        except BaseException:
            sock.close()
            raise

    async def subscribe(self, subject: str, handler: Handler) -> None:
        sid = len(self._handlers) + 1
        self._handlers[sid] = handler
        await self._send([f"SUB {subject} {sid}\r\n".encode()])

    async def publish(self, subject: str, parts: Sequence, reply: str = "") -> None:
        """One message whose payload is `parts` in order (bytes or memoryviews, not copied)."""
        size = sum(len(p) for p in parts)
        if size > self.max_payload:
            raise ValueError(f"payload {size} over the server's max_payload {self.max_payload}")
        head = f"PUB {subject} {reply} {size}\r\n" if reply else f"PUB {subject} {size}\r\n"
        await self._send([head.encode(), *parts, _CRLF])

    async def flush(self) -> None:
        """Returns once the server has processed everything sent before (a PING's PONG)."""
        pong = asyncio.get_running_loop().create_future()
        self._pongs.append(pong)
        await self._send([b"PING\r\n"])
        await pong

    async def close(self) -> None:
        self._closed("closed")
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    def _closed(self, why: str) -> None:
        if self.closed.is_set():
            return
        self.error = why
        self.closed.set()
        reader = self._reader
        if reader is not None and not reader.done() and reader is not asyncio.current_task():
            reader.cancel()  # close once it has left the socket (its pending read unregistered)
            reader.add_done_callback(lambda _: self.sock.close())
        else:
            self.sock.close()
        for pong in self._pongs:
            if not pong.done():
                pong.set_exception(ConnectionError(why))
        if self.on_close is not None:
            self.on_close()

    async def _send(self, parts: list) -> None:
        if self.closed.is_set():
            raise ConnectionError(f"wire closed: {self.error}")
        loop = asyncio.get_running_loop()
        async with self._write:
            views = [memoryview(p).cast("B") for p in parts if len(p)]
            try:
                while views:
                    try:
                        sent = self.sock.sendmsg(views[:_MAX_IOV])
                    except BlockingIOError:
                        sent = 0
                    while views and sent >= len(views[0]):
                        sent -= len(views[0])
                        views.pop(0)
                    if views:
                        views[0] = views[0][sent:]
                        await _writable(loop, self.sock)
            except OSError as exc:
                self._closed(repr(exc))
                raise ConnectionError(f"wire send failed: {exc!r}") from exc

    # --- reading ---------------------------------------------------------------------------------

    async def _fill(self) -> None:
        """Read more protocol into the staging buffer (at least one byte), or fail on EOF."""
        if self._have == len(self._staging):
            raise ConnectionError("protocol line too long")
        n = await asyncio.get_running_loop().sock_recv_into(self.sock, memoryview(self._staging)[self._have:])
        if n == 0:
            raise ConnectionError("server closed the connection")
        self._have += n

    def _take(self, n: int) -> None:
        rest = self._have - n
        self._staging[:rest] = self._staging[n:self._have]
        self._have = rest

    async def _read_line(self) -> bytes:
        while (end := self._staging.find(_CRLF, 0, self._have)) < 0:
            if self._have >= _MAX_LINE:
                raise ConnectionError("protocol line too long")
            await self._fill()
        line = bytes(self._staging[:end])
        self._take(end + 2)
        return line

    async def _read_payload(self, size: int) -> bytearray:
        """`size` bytes and the CRLF after them: staged bytes first, the rest straight from the socket."""
        out = bytearray(size)
        staged = min(self._have, size)
        out[:staged] = self._staging[:staged]
        self._take(staged)
        view, got = memoryview(out), staged
        loop = asyncio.get_running_loop()
        while got < size:
            n = await loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise ConnectionError("server closed the connection")
            got += n
        while self._have < 2:
            await self._fill()
        self._take(2)
        return out

    async def _read_loop(self) -> None:
        try:
            while True:
                line = await self._read_line()
                op = line[:4].upper()
                if op == b"MSG ":
                    args = line.split()  # MSG subject sid [reply] size
                    payload = await self._read_payload(int(args[-1]))
                    await self._deliver(int(args[2]), args[1].decode(), payload)
                elif op == b"HMSG":
                    args = line.split()  # HMSG subject sid [reply] header-size total-size
                    payload = await self._read_payload(int(args[-1]))
                    head_len = int(args[-2])
                    if payload[:head_len].split(_CRLF, 1)[0].split()[1:2] == [b"503"]:
                        await self._deliver(int(args[2]), args[1].decode(), None)
                    elif len(payload) > head_len:
                        await self._deliver(int(args[2]), args[1].decode(), payload[head_len:])
                elif op == b"PING":
                    await self._send([b"PONG\r\n"])
                elif op == b"PONG":
                    if self._pongs:
                        pong = self._pongs.pop(0)
                        if not pong.done():
                            pong.set_result(None)
                elif op == b"-ERR":
                    raise ConnectionError(line.decode(errors="replace"))
                # +OK and INFO updates need nothing
        except asyncio.CancelledError:
            raise
        except (OSError, ValueError, IndexError) as exc:  # ConnectionError is an OSError
            self._closed(repr(exc))

    async def _deliver(self, sid: int, subject: str, payload: bytearray | None) -> None:
        handler = self._handlers.get(sid)
        if handler is not None:
            await handler(subject, payload)


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    done = loop.create_future()
    loop.add_writer(sock, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_writer(sock)
