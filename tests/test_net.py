"""free_port: never the same port twice in a process, never one reserved for a configured server."""

from __future__ import annotations

import socket

from kvmesh.net import claimed, free_port, port_in_use, reserve


def test_picked_ports_are_distinct_and_avoid_reserved_ones() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        configured = s.getsockname()[1]  # free again once this closes: the kernel may offer it next
    reserve(configured, 0)
    assert claimed(configured)
    picked = [free_port() for _ in range(300)]  # the kernel alone repeats ports within a few hundred picks
    assert len(set(picked)) == len(picked)
    assert configured not in picked
    assert all(claimed(p) for p in picked)


def test_port_in_use_sees_a_listener() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert port_in_use(s.getsockname()[1])
    assert not port_in_use(free_port())
