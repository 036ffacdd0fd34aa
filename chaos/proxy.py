"""A user-space TCP fault proxy: sits between a service and NATS or S3 and misbehaves on demand.

`FaultProxy(target_port).start()` listens on a free loopback port and
forwards every connection to the target; `set(Fault(...))` changes what
happens to bytes from then on: added latency with jitter, a bandwidth cap,
slicing into small writes, blackhole (bytes swallowed, connections kept),
reset (every connection, open or new, closed with RST). It runs its own
asyncio loop in a daemon thread; `stop()` closes everything it opened.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from dataclasses import dataclass, field

from kvmesh.net import free_port


@dataclass(frozen=True, slots=True)
class Fault:
    """What the proxy does to traffic; the default passes it through untouched."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0  # uniform +-jitter on top of latency, per chunk
    bandwidth_bps: float = 0.0  # 0 = unlimited
    slice_bytes: int = 0  # 0 = forward chunks whole
    blackhole: bool = False
    reset: bool = False


@dataclass(slots=True)
class FaultProxy:
    target_port: int
    target_host: str = "127.0.0.1"
    port: int = 0
    fault: Fault = field(default_factory=Fault)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.AbstractServer | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _rng: random.Random = field(default_factory=lambda: random.Random(0))

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self.port = self.port or free_port()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"fault-proxy-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise TimeoutError("fault proxy did not start listening")
        return self

    def _run(self, ready: threading.Event) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True))
        ready.set()
        self._loop.run_forever()

    def set(self, fault: Fault) -> None:
        """Apply a fault from now on; a reset also kills every open connection at once."""
        self.fault = fault
        if fault.reset and self._loop is not None:
            self._loop.call_soon_threadsafe(self._reset_all)

    def heal(self) -> None:
        self.set(Fault())

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            _abort(writer)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.fault.reset:
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            _abort(writer)
            return
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except asyncio.CancelledError:
            pass  # stop() cancels open pipes; the server's callback must not log that as an error
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                _abort(w)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                fault = self.fault
                if fault.reset:
                    return
                if fault.blackhole:
                    continue  # swallowed: the peer sees a silent, open connection
                delay = fault.latency_ms + (self._rng.uniform(-fault.jitter_ms, fault.jitter_ms) if fault.jitter_ms else 0)
                if delay > 0:
                    await asyncio.sleep(delay / 1000)
                step = fault.slice_bytes or len(data)
                for i in range(0, len(data), step):
                    part = data[i:i + step]
                    writer.write(part)
                    await writer.drain()
                    if fault.bandwidth_bps > 0:
                        await asyncio.sleep(len(part) / fault.bandwidth_bps)
        except (ConnectionError, OSError):
            return

    def stop(self) -> None:
        if self._loop is None:
            return
        loop = self._loop

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            self._reset_all()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), not a graceful FIN: the peer sees 'connection reset'."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
