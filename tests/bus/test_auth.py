"""NATS locked down, against a real nats-server with the local stack's users (shared/bus/permissions.py).

Refusals are asserted on the error nats-py reports (the server's -ERR), waited
for as an event; every role is also shown doing its own job on the same server.
"""

from __future__ import annotations

import asyncio
import dataclasses

import nats
import nats.errors
import pytest
import torch
from kvmesh.bus.client_auth import ClientAuth, connect_kwargs
from kvmesh.bus.connection import close, connect
from kvmesh.bus.permissions import inbox_prefix, permissions
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.config import BusSettings
from kvmesh.engine.kv_block import KVBlock
from kvmesh.protocol import subjects
from kvmesh.protocol.streams import JOBS, declare_all, declare_consumer, worker_consumer
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.miss import Miss, MissCounters
from kvmesh.transfer.nats_wire import NatsWire
from kvmesh.transfer.peer_nats import (
    NatsPeerClient,
    NatsPeerServer,
    peer_credit_subject,
    peer_fetch_subject,
)
from nats.aio.client import Client as NATS

WAIT_S = 10.0
FP = "fp-auth-test"


@dataclasses.dataclass
class Client:
    """A connection as one user, with every asynchronous error the server sent kept in order."""

    nc: NATS
    errors: asyncio.Queue

    async def refused(self) -> str:
        """The next error the server reports (a permissions violation), waited for."""
        return str(await asyncio.wait_for(self.errors.get(), WAIT_S)).lower()


def auth_of(creds, user: str, inbox_id: str | None = None) -> ClientAuth:
    role, password = creds.users[user]
    return ClientAuth(user=user, password=password, inbox_prefix=inbox_prefix(role, inbox_id or user))


async def open_client(server, creds, user: str, inbox_id: str | None = None) -> Client:
    errors: asyncio.Queue = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        await errors.put(exc)

    nc = await nats.connect(**connect_kwargs(server.url, auth_of(creds, user, inbox_id)), error_cb=on_error,
                            allow_reconnect=False)
    return Client(nc, errors)


@pytest.fixture
async def bus(auth_nats_server):
    """Open clients by user name; all closed at the end. Streams declared by admin."""
    server, creds = auth_nats_server
    opened: list[Client] = []

    async def client(user: str, inbox_id: str | None = None) -> Client:
        c = await open_client(server, creds, user, inbox_id)
        opened.append(c)
        return c

    admin = await client("admin")
    await declare_all(admin.nc.jetstream())
    yield client
    for c in opened:
        await c.nc.close()


async def test_unauthenticated_and_wrong_password_are_refused(auth_nats_server) -> None:
    server, creds = auth_nats_server
    with pytest.raises(nats.errors.Error) as anonymous:
        await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0)
    assert "authorization violation" in str(anonymous.value).lower()
    wrong = dataclasses.replace(auth_of(creds, "prefill-0"), password="not-the-password")
    with pytest.raises(nats.errors.Error) as bad:
        await nats.connect(**connect_kwargs(server.url, wrong), allow_reconnect=False, max_reconnect_attempts=0)
    assert "authorization violation" in str(bad.value).lower()
    # the services' connect gives up with the reason, and never prints the password
    quick = BusSettings(connect_timeout_s=1.0, connect_retry_total_s=2.0, reconnect_wait_max_s=0.2)
    with pytest.raises(ConnectionError) as gave_up:
        await connect(server.url, "wrong-password", quick, wrong)
    assert "authorization violation" in str(gave_up.value).lower() and "not-the-password" not in str(gave_up.value)


# (user, subject published) that the server must refuse
WRONG_PUBLISHES = [
    ("decode-0", subjects.jobs_prefill()),  # only the ingress publishes jobs
    ("prefill-0", subjects.jobs_decode("decode-0")),
    ("ingress-0", subjects.kv_events("ingress-0")),  # KV events come from workers (and eviction) only
    ("prefill-0", subjects.kv_events("prefill-1")),  # ... each under its own id
    ("prefill-0", subjects.heartbeat_key("prefill-1")),
    ("prefill-0", subjects.load("prefill-1")),
    ("ingress-0", peer_fetch_subject("prefill-0")),  # only workers make peer-fetch requests
    ("cache_index-0", peer_fetch_subject("prefill-0")),
    ("eviction-0", peer_credit_subject("prefill-0")),
    ("decode-0", subjects.commands("prefill-0")),  # commands come from eviction
    ("ingress-0", "_INBOX.decode.decode-0.x"),  # no fake replies into a worker's inbox
    ("prefill", subjects.jobs_prefill()),  # the per-role user is no wider in kind
    ("vllm-0", subjects.kv_events("prefill-0")),  # a vLLM instance: its own KV events only
    ("vllm-0", subjects.commands("vllm-0")),  # ... no commands, jobs or peer fetches
    ("vllm-0", subjects.jobs_prefill()),
    ("vllm-0", peer_fetch_subject("prefill-0")),
]


@pytest.mark.parametrize("user, subject", WRONG_PUBLISHES)
async def test_a_publish_outside_the_role_is_refused(bus, user: str, subject: str) -> None:
    c = await bus(user)
    await c.nc.publish(subject, b"x")
    err = await c.refused()
    assert "permissions violation for publish" in err and subject.lower() in err


# (user, subject subscribed) that the server must refuse
WRONG_SUBSCRIBES = [
    ("prefill-1", peer_fetch_subject("prefill-0")),  # nobody answers peer fetches for another worker
    ("ingress-0", "_INBOX.decode.>"),  # nobody reads another process's replies (peer data travels there)
    ("decode-0", "_INBOX.prefill.prefill-0.>"),
    ("prefill-0", subjects.abort("prefill-1")),
    ("prefill-0", subjects.TOKENS_ALL),  # token streams are the ingress's to read
    ("eviction-0", subjects.kv_dump("prefill-0")),
    ("vllm-0", subjects.kv_dump("prefill-0")),
    ("vllm-0", subjects.SESSION_EVENTS),
]


@pytest.mark.parametrize("user, subject", WRONG_SUBSCRIBES)
async def test_a_subscription_outside_the_role_is_refused(bus, user: str, subject: str) -> None:
    c = await bus(user)
    await c.nc.subscribe(subject)
    err = await c.refused()
    assert "permissions violation for subscription" in err and subject.lower() in err


async def test_a_worker_cannot_bind_another_workers_consumer(bus) -> None:
    c = await bus("prefill-0")
    theirs = worker_consumer(JOBS, "prefill", "prefill-1", subjects.jobs_prefill("prefill-1"))
    attempt = asyncio.ensure_future(declare_consumer(c.nc.jetstream(timeout=WAIT_S), theirs))
    err = await c.refused()
    assert "permissions violation for publish" in err and "consumer.create.jobs.prefill-prefill-1" in err
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)


async def test_each_role_does_its_own_job(bus) -> None:
    ingress, prefill, index = await bus("ingress-0"), await bus("prefill-0"), await bus("cache_index-0")
    own = worker_consumer(JOBS, "prefill", "prefill-0", subjects.jobs_prefill("prefill-0"))
    pjs = prefill.nc.jetstream()
    await declare_consumer(pjs, own)
    sub = await pjs.pull_subscribe_bind(durable=own.durable, stream=own.stream)
    ack = await ingress.nc.jetstream().publish(subjects.jobs_prefill("prefill-0"), b"job")
    assert ack.stream == JOBS.name
    msgs = await sub.fetch(1, timeout=WAIT_S)
    assert msgs[-1].data == b"job"
    for m in msgs:
        await m.ack_sync()
    assert (await pjs.publish(subjects.kv_events("prefill-0"), b"events")).stream == "KV_EVENTS"
    assert (await pjs.publish(subjects.heartbeat_key("prefill-0"), b"beat")).stream == "KV_workers"

    async def answer(msg) -> None:  # the cache index answers a lookup through allow_responses
        await msg.respond(b"answer:" + msg.data)

    await index.nc.subscribe(subjects.INDEX_LOOKUP, queue="cache-index", cb=answer)
    await index.nc.flush()
    assert (await ingress.nc.request(subjects.INDEX_LOOKUP, b"q", timeout=WAIT_S)).data == b"answer:q"
    assert (await prefill.nc.request(subjects.INDEX_LOOKUP, b"w", timeout=WAIT_S)).data == b"answer:w"
    for c in (ingress, prefill, index):
        assert c.errors.empty(), c.errors.get_nowait()


def _chain(n: int) -> list[KVBlock]:
    gen = torch.Generator().manual_seed(7)
    out, parent = [], None
    for i in range(n):
        block_hash = bytes([i + 1]) * 32
        out.append(KVBlock(block_hash, parent, tuple(range(16)), torch.randn((2, 2, 16, 2, 8), generator=gen)))
        parent = block_hash
    return out


async def test_peer_fetch_between_workers_on_the_lean_wire(auth_nats_server) -> None:
    """prefill-0 serves its L2 to decode-0: both authenticate, bulk bytes take the second (wire) connection."""
    server, creds = auth_nats_server
    quick = BusSettings(connect_timeout_s=2.0, connect_retry_total_s=10.0)
    owner_nc = await connect(server.url, "owner", quick, auth_of(creds, "prefill-0"))
    reader_nc = await connect(server.url, "reader", quick, auth_of(creds, "decode-0"))
    tier = HostTier(1 << 26, LRUPolicy(), FP, worker_id="prefill-0")
    blocks = _chain(3)
    for b in blocks:
        tier.put_block(b)
    owner = NatsPeerServer(owner_nc, tier, "prefill-0", chunk_bytes=4096)
    reader = NatsPeerClient(reader_nc, FP, MissCounters(), timeout_s=WAIT_S)
    await owner.start()
    await reader.start()
    try:
        assert isinstance(reader._link, NatsWire)  # the credentials reached the wire too
        got = await reader.fetch_many("prefill-0", [b.block_hash for b in blocks])
        for b, g in zip(blocks, got, strict=True):
            assert not isinstance(g, Miss) and torch.equal(g.to_kv_block().data, b.data)
    finally:
        await reader.close()
        await owner.stop()
        await close(owner_nc)
        await close(reader_nc)


async def test_a_vllm_instance_reports_its_blocks_and_answers_dumps_of_them(bus) -> None:
    """The connector's fleet link (shared/connectors/vllm/fleet.py) as the `vllm` user: its heartbeat, its
    KV events, and the cache index's dump request answered."""
    vllm, index = await bus("vllm-0"), await bus("cache_index-0")
    js = vllm.nc.jetstream()
    assert (await js.publish(subjects.kv_events("vllm-0"), b"events")).stream == "KV_EVENTS"
    assert (await js.publish(subjects.heartbeat_key("vllm-0"), b"beat")).stream == "KV_workers"

    async def dump(msg) -> None:
        await vllm.nc.publish(msg.reply, b"state")
    await vllm.nc.subscribe(subjects.kv_dump("vllm-0"), cb=dump)
    await vllm.nc.flush()
    assert (await index.nc.request(subjects.kv_dump("vllm-0"), b"dump", timeout=WAIT_S)).data == b"state"
    for c in (vllm, index):
        assert c.errors.empty(), c.errors.get_nowait()


async def test_the_per_role_user_takes_any_id(bus) -> None:
    """The fallback's limit, pinned down: any id at all (a wildcard cannot say "prefill ids"), yet only its kind."""
    c = await bus("prefill", inbox_id="prefill-7")
    js = c.nc.jetstream()
    assert (await js.publish(subjects.kv_events("prefill-7"), b"events")).stream == "KV_EVENTS"
    assert (await js.publish(subjects.kv_events("decode-7"), b"events")).stream == "KV_EVENTS"
    await c.nc.publish(subjects.commands("prefill-7"), b"x")
    err = await c.refused()
    assert "permissions violation for publish" in err and subjects.commands("prefill-7") in err


def test_permission_table_properties() -> None:
    """The table itself: jobs only from the ingress; peer fetch only from workers; own ids only."""
    for role in ("prefill", "decode", "cache-index", "eviction"):
        assert not any(s.startswith("kvmesh.jobs") for s in permissions(role, f"{role}-0").publish)
    for role in ("ingress", "cache-index", "eviction"):
        assert not any(s.startswith("kvmesh.peer.") for s in permissions(role, f"{role}-0").publish)
    p = permissions("decode", "decode-3")
    assert "kvmesh.kv.events.decode-3" in p.publish and "$KV.workers.decode-3" in p.publish
    assert not any(s.endswith((".>", ".*")) for s in p.publish if s.startswith(("kvmesh.kv.events", "$KV.workers")))


def test_the_local_stacks_vllm_user_takes_any_instance_id(tmp_path) -> None:
    """`kvmesh up` adds a per-role `vllm` user for the vLLM instances it does not start: any id, its kind only."""
    from kvmesh.config import Settings
    from kvmesh.stack.launch import stack_nats_users

    creds = stack_nats_users(Settings(), tmp_path, [])
    assert creds is not None and creds.users["vllm"][0] == "vllm"
    [user] = [u for u in creds.server_auth().users if u.name == "vllm"]
    assert user.permissions == permissions("vllm")  # the per-role user (worker id None)
    assert "kvmesh.kv.events.*" in user.permissions.publish and not any(
        s.startswith(("kvmesh.jobs", "kvmesh.cmd", "kvmesh.peer")) for s in user.permissions.publish)
