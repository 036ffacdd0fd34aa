"""Read the TRAFFIC stream of the local stack recorded in a state dir, as its admin NATS user."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import nats
from kvmesh.bus.client_auth import connect_kwargs
from kvmesh.config import load_settings
from kvmesh.credentials.nats import admin_auth
from kvmesh.protocol.traffic import TrafficRecord
from kvmesh.stack.state import load_state
from kvmesh.traffic.reader import read_records

CONNECT_TIMEOUT_S = 5


class NoStack(Exception):
    """No running stack is recorded in the state dir."""


async def read_stack_records(state_dir: Path, since: float | None) -> list[TrafficRecord]:
    """The records the stack's TRAFFIC stream holds from `since` (unix seconds; None: all); raises NoStack."""
    state_dir = state_dir.resolve()
    state = load_state(state_dir)
    if state is None or not state.nats_url:
        raise NoStack(f"no kvmesh stack is recorded in {state_dir}")
    auth = admin_auth(state_dir)
    tls_ca = load_settings().nats.tls_ca
    if auth is not None and tls_ca:
        auth = dataclasses.replace(auth, tls_ca=tls_ca)
    nc = await nats.connect(**connect_kwargs(state.nats_url, auth), allow_reconnect=False,
                            connect_timeout=CONNECT_TIMEOUT_S)
    try:
        return await read_records(nc.jetstream(), since)
    finally:
        await nc.close()
