"""Batch peer fetch between processes that share no memory, and its wire format and flow control.

The owner is a child process serving a heap-arena L2 (no shared memory) over a
real nats-server; the parent fetches a chain larger than one max_payload
message in one `fetch_many`, and checks every byte against the chain the child
built from the same seed.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os

import nats
import pytest
import torch
from kvmesh.aio import wait_event
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.miss import Miss, MissCounters, MissReason
from kvmesh.transfer.credit_window import CreditWindow, TransferCancelled
from kvmesh.transfer.nats_wire import NatsWire, WireUnsupported
from kvmesh.transfer.peer_nats import NatsPeerClient, NatsPeerServer, peer_fetch_subject
from kvmesh.transfer.pieces import (
    BlockAssembly,
    decode_request,
    encode_request,
    pack_messages,
)

from .conftest import FINGERPRINT, make_chain

SHAPE = (16, 2, 16, 8, 64)  # 512 KiB of fp16 per block
CHAIN = 24  # 12 MiB: more than one 8 MiB message


def _serve_l2(url: str, worker: str, ready, stop) -> None:
    """Child process: an owner whose L2 lives on its own heap, served until `stop` is set."""

    async def main() -> None:
        nc = await nats.connect(url)
        tier = HostTier(1 << 34, LRUPolicy(), FINGERPRINT, worker)
        for b in make_chain(CHAIN, seed=7, shape=SHAPE, dtype=torch.float16):
            tier.put_block(b)
        server = NatsPeerServer(nc, tier, worker)
        await server.start()
        await nc.flush()  # the subscriptions are on the server before the parent asks
        ready.set()
        await asyncio.to_thread(stop.wait)
        await server.stop()
        await nc.close()

    asyncio.run(main())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _tier_holding(chain, worker: str) -> HostTier:
    """A 1 GiB host tier of `worker` holding every block of `chain`."""
    tier = HostTier(1 << 30, LRUPolicy(), FINGERPRINT, worker)
    for b in chain:
        tier.put_block(b)
    return tier


async def test_fetch_many_from_another_process(nats_server) -> None:
    worker = f"owner-{os.getpid()}"
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_serve_l2, args=(nats_server.url, worker, ready, stop), daemon=True)
    child.start()
    nc = await nats.connect(nats_server.url)
    counters = MissCounters()
    client = NatsPeerClient(nc, FINGERPRINT, counters, timeout_s=10.0)
    await client.start()
    try:
        assert await asyncio.to_thread(ready.wait, 120), "the owner process did not come up"
        assert nc.max_payload < CHAIN * 512 * 1024
        chain = make_chain(CHAIN, seed=7, shape=SHAPE, dtype=torch.float16)
        absent = bytes(32)
        hashes = [b.block_hash for b in chain[:10]] + [absent] + [b.block_hash for b in chain[10:]]
        got = await client.fetch_many(worker, hashes)
        assert len(got) == len(hashes)
        assert isinstance(got[10], Miss) and got[10].reason is MissReason.NOT_FOUND
        blocks = got[:10] + got[11:]
        for want, have in zip(chain, blocks):
            assert not isinstance(have, Miss), have
            assert have.header.block_hash == want.block_hash and have.header.parent_hash == want.parent_hash
            assert _same(have.to_kv_block().data, want.data)
        assert counters.get(Tier.PEER, MissReason.NOT_FOUND) == 1 and counters.total() == 1
        single = await client.fetch(worker, chain[3].block_hash)
        assert _same(single.data, blocks[3].data)
        assert await client.fetch_many(worker, []) == []
    finally:
        stop.set()
        await asyncio.to_thread(child.join, 60)
    # The owner is gone: every block is a miss (no responders, at once), nothing hangs.
    gone = await client.fetch_many(worker, [b.block_hash for b in chain[:3]])
    assert [m.reason for m in gone] == [MissReason.UNAVAILABLE] * 3
    await client.close()
    await nc.close()


async def test_a_peer_that_stops_sending_ends_in_misses_and_keeps_what_arrived(nats_server) -> None:
    """A responder that sends the first message (block 0) and then nothing: the fetch still returns."""
    chain = make_chain(3, seed=1, shape=(2, 2, 16, 4, 64))
    tier = _tier_holding(chain, "src")
    views = [tier.get_encoded(b.block_hash) for b in chain]
    nc = await nats.connect(nats_server.url)

    async def stalls(msg) -> None:
        hashes, _ = decode_request(msg.data)
        first = next(pack_messages(((i, views[i]) for i in range(len(hashes))), len(views[0]) + 64))
        await nc.publish(msg.reply, b"".join(first))

    sub = await nc.subscribe(peer_fetch_subject("stuck"), cb=stalls)
    counters = MissCounters()
    client = NatsPeerClient(nc, FINGERPRINT, counters, timeout_s=0.5)
    await client.start()
    try:
        got = await client.fetch_many("stuck", [b.block_hash for b in chain])
        assert _same(got[0].to_kv_block().data, chain[0].data)
        assert [m.reason for m in got[1:]] == [MissReason.UNAVAILABLE] * 2
        assert counters.get(Tier.PEER, MissReason.UNAVAILABLE) == 2
    finally:
        await sub.unsubscribe()
        await client.close()
        await nc.close()


@pytest.mark.parametrize("use_wire", [True, False], ids=["wire", "nats-py"])
async def test_a_window_smaller_than_the_chain_moves_it_on_credits(nats_server, use_wire: bool) -> None:
    """Window of one message: every further message waits for the client's credit (on both links)."""
    chain = make_chain(12, seed=2, shape=(2, 2, 16, 4, 64))  # 32 KiB blocks
    tier = _tier_holding(chain, "windowed")
    nc = await nats.connect(nats_server.url)
    server = NatsPeerServer(nc, tier, "windowed", chunk_bytes=20_000, max_window_bytes=20_000, use_wire=use_wire)
    client = NatsPeerClient(nc, FINGERPRINT, MissCounters(), timeout_s=5.0, window_bytes=1, use_wire=use_wire)
    await server.start()
    await client.start()
    try:
        got = await client.fetch_many("windowed", [b.block_hash for b in chain])
        assert all(_same(g.to_kv_block().data, b.data) for g, b in zip(got, chain))
        assert isinstance(client._link, NatsWire) is use_wire
    finally:
        await server.stop()
        await client.close()
        await nc.close()


async def test_credit_window_bounds_bytes_in_flight() -> None:
    flow = CreditWindow(100)
    await flow.reserve(150, stall_s=1.0)  # nothing in flight: one message may exceed the window
    waiting = asyncio.ensure_future(flow.reserve(10, stall_s=5.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    flow.credit(60)  # 90 in flight + 10 = 100: fits
    await waiting
    assert flow.sent - flow.received == 100
    with pytest.raises(TimeoutError):
        await flow.reserve(1, stall_s=0.01)  # no credit comes
    flow.credit(0, cancel=True)
    with pytest.raises(TransferCancelled):
        await flow.reserve(1, stall_s=1.0)


@pytest.mark.parametrize("limit", [256, 5_000, 70_000, 1 << 20])
def test_pieces_round_trip(limit: int) -> None:
    gen = torch.Generator().manual_seed(limit)
    sizes = [int(s) for s in torch.randint(1, 200_000, (30,), generator=gen)]
    blocks = [None if i % 7 == 3 else memoryview(bytes(torch.randint(0, 256, (s,), generator=gen,
                                                                        dtype=torch.uint8).numpy()))
              for i, s in enumerate(sizes)]
    assembly = BlockAssembly(len(blocks))
    for parts in pack_messages(enumerate(blocks), limit):
        message = b"".join(parts)
        assert len(message) <= limit
        assembly.add(message)
    assert assembly.done
    for i, b in enumerate(blocks):
        assert assembly.missing[i] == (b is None)
        assert b is None or bytes(assembly.blocks[i]) == bytes(b)
        if b is not None and len(b) + 16 <= limit:  # fits one message: never split
            assert isinstance(assembly.blocks[i], memoryview)


def test_a_piece_that_does_not_fit_the_request_is_refused() -> None:
    msg = b"".join(next(pack_messages([(0, memoryview(b"x" * 100))], 1024)))
    with pytest.raises(ValueError):
        BlockAssembly(0).add(msg)  # no block 0 was asked for
    with pytest.raises(ValueError):
        BlockAssembly(1).add(msg[:-1])  # truncated
    twice = BlockAssembly(1)
    twice.add(msg)
    with pytest.raises(ValueError):
        twice.add(msg)  # already complete
    hashes = [bytes([i]) * 32 for i in range(3)]
    assert decode_request(encode_request(hashes, 1 << 20)) == (hashes, 1 << 20)
    with pytest.raises(ValueError):
        encode_request([b"short"], 1)


async def test_a_broken_wire_ends_the_transfer_at_once(fresh_nats_server) -> None:
    """The data connection drops mid-transfer (the server stops): misses now, not after the timeout."""
    chain = make_chain(3, seed=3, shape=(2, 2, 16, 4, 64))
    tier = _tier_holding(chain, "src")
    views = [tier.get_encoded(b.block_hash) for b in chain]
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    nc = await nats.connect(fresh_nats_server.url, allow_reconnect=False, closed_cb=on_closed)
    first_sent = asyncio.Event()

    async def sends_one_then_waits(msg) -> None:
        first = next(pack_messages([(0, views[0])], len(views[0]) + 64))
        await nc.publish(msg.reply, b"".join(first))
        first_sent.set()

    await nc.subscribe(peer_fetch_subject("slow"), cb=sends_one_then_waits)
    client = NatsPeerClient(nc, FINGERPRINT, MissCounters(), timeout_s=600.0)
    await client.start()
    fetch = asyncio.ensure_future(client.fetch_many("slow", [b.block_hash for b in chain]))
    await first_sent.wait()
    await nc.flush()
    fresh_nats_server.stop()
    got = await fetch
    assert [getattr(g, "detail", "") for g in got[1:]] == ["slow: data connection lost"] * 2
    await client.close()
    # with reconnects off nats-py closes the connection itself; a close() racing that one can be
    # cancelled inside nats-py, so wait for its own close instead
    assert await wait_event(closed, 30.0)


async def test_the_wire_refuses_a_server_that_wants_tls() -> None:
    async def greet(reader, writer) -> None:
        writer.write(b'INFO {"server_id":"x","tls_required":true,"max_payload":1048576}\r\n')
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(WireUnsupported):
            await NatsWire.connect(f"nats://127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()


def test_transfer_engines_bench_runs_the_kvmesh_paths() -> None:
    """bench/transfer_engines.py end to end at a tiny size (its numbers are not checked, only its shape)."""
    from kvmesh.bench.transfer_engines import run

    only = ["memcpy", "kvmesh_shm", "nats_per_block", "nats_batch"]
    result = run(argparse.Namespace(mib=8, block_mib=2, reps=1, only=only))
    paths = result["paths"]
    assert set(paths) == {"memcpy", "kvmesh_shm", "nats_per_block", "nats_batch"}
    assert all(paths[k]["GBps"] > 0 and "vs_memcpy" in paths[k] for k in paths), paths
    assert result["nats_batch_vs_per_block"] > 0
