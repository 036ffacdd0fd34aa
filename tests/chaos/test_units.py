"""The chaos building blocks on their own: the fault proxy against a real echo server, the miss export."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from kvmesh.chaos.proxy import Fault, FaultProxy
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.miss import Miss, MissCounters, MissReason
from prometheus_client import CollectorRegistry, generate_latest


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            return


@pytest.fixture
def proxy(echo_port: int) -> Iterator[FaultProxy]:
    p = FaultProxy(echo_port).start()
    yield p
    p.stop()


def _roundtrip(port: int, payload: bytes, timeout_s: float = 5.0) -> tuple[bytes, float]:
    t = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    return got, time.monotonic() - t


def test_passthrough_and_latency(proxy: FaultProxy) -> None:
    assert _roundtrip(proxy.port, b"hello")[0] == b"hello"
    proxy.set(Fault(latency_ms=150))
    got, took = _roundtrip(proxy.port, b"slow")
    assert got == b"slow" and took >= 0.3  # added both ways


def test_bandwidth_cap_and_slicing(proxy: FaultProxy) -> None:
    proxy.set(Fault(bandwidth_bps=200_000, slice_bytes=1000))
    payload = bytes(range(256)) * 200  # 51 200 bytes: >= 0.25 s at 200 kB/s (the two ways overlap)
    got, took = _roundtrip(proxy.port, payload)
    assert got == payload and took >= 0.25


def test_blackhole_then_heal(proxy: FaultProxy) -> None:
    proxy.set(Fault(blackhole=True))
    with pytest.raises(TimeoutError):
        _roundtrip(proxy.port, b"lost", timeout_s=0.5)
    proxy.heal()
    assert _roundtrip(proxy.port, b"back")[0] == b"back"


def test_reset_kills_open_and_new_connections(proxy: FaultProxy) -> None:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.sendall(b"x")
    assert sock.recv(10) == b"x"
    proxy.set(Fault(reset=True))
    with pytest.raises(ConnectionResetError):
        sock.sendall(b"y")
        if not sock.recv(10):
            raise ConnectionResetError("closed")
    sock.close()
    with pytest.raises((ConnectionResetError, ConnectionAbortedError)):
        got, _ = _roundtrip(proxy.port, b"z")
        if not got:
            raise ConnectionResetError("closed")


def test_miss_counters_exported_to_prometheus() -> None:
    counters, registry = MissCounters(), CollectorRegistry()
    counters.export(registry)
    counters.record(Miss(Tier.L3, MissReason.CHECKSUM))
    counters.record(Miss(Tier.L3, MissReason.CHECKSUM))
    text = generate_latest(registry).decode()
    assert 'kvmesh_tier_miss_total{reason="checksum",tier="L3"} 2.0' in text


def test_overload_error_carries_retry_after() -> None:
    """Found by the overload scenario: a 503 for too many in flight had no Retry-After."""
    from kvmesh.ingress.core.errors import Dialect, ErrorKind
    from kvmesh.ingress.core.types import GatewayError
    from kvmesh.ingress.server.app import gateway_api_error

    busy = gateway_api_error(GatewayError(ErrorKind.OVERLOADED, "too many requests in flight (6)"))
    assert busy.status(Dialect.OPENAI) == 503 and busy.headers() == {"retry-after": "1"}
    assert gateway_api_error(GatewayError(ErrorKind.OVERLOADED, "gone", retriable=False)).headers() == {}


def _outcomes(spec: list[tuple[float, float, bool]]) -> list:
    from kvmesh.chaos.load import Outcome

    return [Outcome("p", start, start + latency, ok) for start, latency, ok in spec]


def test_recovery_is_the_first_window_whose_p99_is_back() -> None:
    from kvmesh.chaos.invariants import RECOVERY_WINDOW_S, recovery_s

    steady = [(100.0 + 0.5 * i, 0.2, True) for i in range(60)]  # a request every 0.5 s, 200 ms each
    assert recovery_s(_outcomes(steady), 100.0, 200.0) == 0.0
    # errors until 104 s, then slow (1 s > 2 x 200 ms) until 108 s: latency is back from just after 107.5 s
    troubled = [(s, 1.0 if s < 108 else lat, ok and s >= 104) for s, lat, ok in steady]
    assert recovery_s(_outcomes(troubled), 100.0, 200.0) == pytest.approx(7.5, abs=1e-3)
    assert recovery_s(_outcomes(troubled), 100.0, 600.0) == pytest.approx(3.5, abs=1e-3)  # errors still count
    assert recovery_s(_outcomes([(s, 1.0, ok) for s, _, ok in steady]), 100.0, 200.0) is None  # never back
    # a window that is not over yet proves nothing
    assert recovery_s(_outcomes([o for o in steady if o[0] < 100.0 + RECOVERY_WINDOW_S - 1]), 100.0, 200.0) is None
