"""Loopback ports for the servers a process starts.

The kernel hands out a port as soon as the probe socket that found it closes, so two
servers picked one after the other, or a picked one and a configured one that has not
bound yet, can end up on the same port. `free_port` therefore never returns a port twice
in one process, nor one that `reserve` claimed for a configured server. The record is
process-wide because the port space it guards is.
"""

from __future__ import annotations

import socket
import threading

_lock = threading.Lock()
_claimed: set[int] = set()


def reserve(*ports: int) -> None:
    """Claim configured ports (0 = none) so that `free_port` never hands them out."""
    with _lock:
        _claimed.update(p for p in ports if p)


def claimed(port: int) -> bool:
    with _lock:
        return port in _claimed


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, distinct from every port this process picked or reserved."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        with _lock:
            if port not in _claimed:
                _claimed.add(port)
                return port


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False
