"""Is an endpoint reachable (TCP accepts) and ready (answers like the real thing)?

Used by `up` while it waits and by `status`; every check has a short
timeout so a hung server reads as "not ready", never as a hang.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvmesh.credentials.s3 import S3Credentials
from kvmesh.stack.state import Endpoint

TIMEOUT_S = 1.0


@dataclass(slots=True)
class EndpointStatus:
    name: str
    url: str
    reachable: bool
    ready: bool


DEFAULT_PORTS = {"nats": 4222, "tls": 4222, "http": 80, "https": 443}


def host_port(url: str, default_port: int) -> tuple[str, int]:
    """host and port of 'scheme://host:port/...' (port defaults by scheme) or of a bare 'host:port'."""
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    return parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORTS.get(parts.scheme, default_port)


def tcp_reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S):
            return True
    except OSError:
        return False


def nats_ready(url: str) -> bool:
    """A NATS server greets every connection with an INFO line."""
    host, port = host_port(url, 4222)
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as s:
            s.settimeout(TIMEOUT_S)
            return s.recv(4).startswith(b"INFO")
    except OSError:
        return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    """Poll `url` until it answers 200: RuntimeError if `proc` exits first, TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode} before {url} answered 200")
        if http_ok(url):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f}s")


def s3_client(endpoint: str, creds: S3Credentials, secure: bool = False, timeout_s: float | None = None):
    """A minio client for 'host:port' or 'http(s)://host:port'; timeout_s bounds every call."""
    from minio import Minio  # imported here: `kvmesh --help` stays fast

    http_client = None
    if timeout_s is not None:
        import urllib3

        http_client = urllib3.PoolManager(timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s), retries=False)
    secure = secure or endpoint.startswith("https://")
    host, port = host_port(endpoint, 443 if secure else 80)
    return Minio(
        f"{host}:{port}", access_key=creds.access_key, secret_key=creds.secret_key, secure=secure,
        http_client=http_client,
    )


def s3_bucket_ready(endpoint: str, bucket: str, creds: S3Credentials | None) -> bool:
    if creds is None:
        return False
    try:
        return s3_client(endpoint, creds, timeout_s=TIMEOUT_S).bucket_exists(bucket)
    except Exception:  # noqa: BLE001 - any S3 or transport error means "not ready"
        return False


def check_endpoint(ep: Endpoint, creds: S3Credentials | None) -> EndpointStatus:
    host, port = host_port(ep.url, 80)
    reachable = tcp_reachable(host, port)
    ready = False
    if reachable:
        if ep.check == "nats":
            ready = nats_ready(ep.url)
        elif ep.check == "http":
            ready = http_ok(ep.url + ep.ready_path)
        else:
            ready = s3_bucket_ready(ep.url, ep.bucket or "", creds)
    return EndpointStatus(name=ep.name, url=ep.url, reachable=reachable, ready=ready)
