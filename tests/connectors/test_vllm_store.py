"""The connector's worker store (no vLLM here): what it keeps in L2, what it offers L3, what it fetches back."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import torch
from kvmesh.connectors.vllm.request_peers import PEERS_PARAM, request_peers
from kvmesh.connectors.vllm.store import StoreView, WorkerStore
from kvmesh.engine.kv_block import KVBlock
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.namespace import namespace_for

FP = "fp-connector-test"
BLOCK = 4  # tokens per block (conftest.py chunks L3 by two)
SHAPE = (2, 2, BLOCK, 2, 8)  # layers, K/V, block size, kv heads, head dim


def chain(n: int, seed: int) -> list[KVBlock]:
    gen = torch.Generator().manual_seed(seed)
    parent, out = None, []
    for i in range(n):
        tokens = tuple(range(i * BLOCK, (i + 1) * BLOCK))
        h = hashlib.sha256((parent or b"") + repr((seed, tokens)).encode()).digest()
        out.append(KVBlock(h, parent, tokens, torch.randn(SHAPE, generator=gen)))
        parent = h
    return out


@pytest.fixture
def store(settings) -> WorkerStore:
    s = WorkerStore(settings, f"vllm-test-{uuid.uuid4().hex[:8]}", FP, BLOCK, block_bytes=4096)
    yield s
    s.close()


def test_kept_blocks_are_fetched_back_and_seen_by_the_scheduler_view(store, settings) -> None:
    blocks = chain(5, seed=1)
    hashes = [b.block_hash for b in blocks]
    assert store.keep("", hashes, {b.block_hash: b for b in blocks}) == 5
    got, _ = store.fetch("", hashes, 2)
    assert [b.header.block_hash for b in got] == hashes[2:]
    assert all(torch.equal(g.data, b.data) for g, b in zip(got, blocks[2:], strict=True))
    view = StoreView(settings, store.l2.worker_id, FP, BLOCK)
    try:
        assert (view.reach("", hashes).l2, view.reach("", hashes).total) == (5, 5)
        assert store.drain(30)
        for h in hashes:  # L2 empty now: the view and the fetch go to L3
            store.l2.remove(h)
        assert (view.reach("", hashes).l2, view.reach("", hashes).total) == (0, 5)
        assert view.reach("abcd", hashes).total == 0  # another tenant's namespace holds nothing
        assert [b.header.block_hash for b in store.fetch("", hashes, 1)[0]] == hashes[1:]
    finally:
        view.close()


def test_a_block_l2_let_go_ends_the_l3_offer_but_not_what_l2_takes(store, settings) -> None:
    blocks = chain(6, seed=2)
    hashes = [b.block_hash for b in blocks]
    store.keep("", hashes[:4], {b.block_hash: b for b in blocks[:4]})
    assert store.drain(30)
    store.l2.remove(hashes[1])  # evicted since; the next step keeps blocks 4 and 5 only
    assert store.keep("", hashes, {b.block_hash: b for b in blocks[4:]}) == 2
    assert hashes[4] in store.l2 and hashes[5] in store.l2
    assert store.drain(30)
    keys = {o.object_name for o in store.l3.client.list_objects(store.l3.bucket, recursive=True)}
    ns = namespace_for("")
    assert store.l3.key(ns, hashes[3]) in keys and store.l3.key(ns, hashes[5]) not in keys  # chunk 3 needs block 1


def test_a_same_host_peer_slab_is_read_before_l3(settings) -> None:
    """Worker b names worker a as its peer: b's view and fetch find what a kept, with nothing in b's L2 or L3."""
    a_id, b_id = (f"vllm-{n}-{uuid.uuid4().hex[:8]}" for n in "ab")
    settings = settings.model_copy(update={"tiers": settings.tiers.model_copy(update={"l3_enabled": False})})
    a = WorkerStore(settings, a_id, FP, BLOCK, block_bytes=4096)
    b = WorkerStore(settings, b_id, FP, BLOCK, block_bytes=4096, peers=[a_id, b_id])
    view = StoreView(settings, b_id, FP, BLOCK, peers=[a_id])
    try:
        blocks = chain(4, seed=3)
        hashes = [x.block_hash for x in blocks]
        a.keep("", hashes, {x.block_hash: x for x in blocks})
        assert len(b.l2) == 0 and b.l3 is None
        assert (view.reach("", hashes).l2, view.reach("", hashes).total) == (4, 4)
        got, _ = b.fetch("", hashes, 0)
        assert [g.header.block_hash for g in got] == hashes
        assert all(torch.equal(g.data, x.data) for g, x in zip(got, blocks, strict=True))
        a.l2.remove(hashes[2])  # the peer lets one go: b's reach and fetch stop there
        assert view.reach("", hashes).total == 2 and len(b.fetch("", hashes, 0)[0]) == 2
    finally:
        view.close()
        b.close()
        a.close()


def test_a_peer_the_request_names_is_read_and_counted(settings) -> None:
    """No configured peers: the worker named in the request's kv_transfer_params is read, and its blocks
    counted as peer blocks; an unnamed worker's slab is not."""
    a_id, b_id = (f"vllm-{n}-{uuid.uuid4().hex[:8]}" for n in "ab")
    settings = settings.model_copy(update={"tiers": settings.tiers.model_copy(update={"l3_enabled": False})})
    a = WorkerStore(settings, a_id, FP, BLOCK, block_bytes=4096)
    b = WorkerStore(settings, b_id, FP, BLOCK, block_bytes=4096)
    view = StoreView(settings, b_id, FP, BLOCK)
    try:
        blocks = chain(3, seed=4)
        hashes = [x.block_hash for x in blocks]
        a.keep("", hashes, {x.block_hash: x for x in blocks})
        named = request_peers({PEERS_PARAM: [a_id, a_id, 7, ""], "other": 1})
        assert named == (a_id,)
        assert view.reach("", hashes).total == 0 and b.fetch("", hashes, 0)[0] == []
        assert view.reach("", hashes, named).total == 3
        got, tiers = b.fetch("", hashes, 1, named)
        assert [g.header.block_hash for g in got] == hashes[1:] and tiers == {Tier.PEER: 2}
    finally:
        view.close()
        b.close()
        a.close()


def test_request_peers_takes_only_a_list_of_ids() -> None:
    assert request_peers(None) == () and request_peers({PEERS_PARAM: "w1"}) == () and request_peers("x") == ()
    assert request_peers({PEERS_PARAM: [f"w{i}" for i in range(20)]}) == tuple(f"w{i}" for i in range(8))
