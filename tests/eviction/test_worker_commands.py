"""The worker-side CommandHandler on a real tiny Engine (on its EngineLoop thread), a HostTier and real S3.

Blocks move as told (L1 -> L2, L2 -> L3, L3 -> L2 by warm-up), blocks in use
or pinned stay, and a later request served from the moved blocks produces
the same greedy tokens as a cold recompute (cache transparency).
"""

from __future__ import annotations

import time

import pytest
from kvmesh.cache_policy.registry import get_policy
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.eviction.messages import Demote, Drop, Retain, Warm, WorkerCommand
from kvmesh.protocol.blocks import Tier
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.worker_commands import CommandHandler
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.l2_host import HostTier

from .helpers import BS, PARAMS, PROMPT, l3_store


@pytest.fixture
async def worker(tiny_loaded):
    engine = Engine(tiny_loaded, EngineSettings(block_size=BS, num_blocks=64))
    loop = EngineLoop(engine)
    loop.start()
    l2 = HostTier(1 << 26, get_policy("lru"), tiny_loaded.fingerprint, "w-test")
    try:
        yield engine, loop, l2
    finally:
        loop.stop()
        l2.close()


def cmd(command) -> WorkerCommand:
    return WorkerCommand(worker="w-test", command_id="c1", command=command)


def cold_tokens(tiny_loaded) -> list[int]:
    return Engine(tiny_loaded, EngineSettings(block_size=BS, num_blocks=64)).generate([PROMPT], PARAMS)[0].token_ids


async def test_demote_l1_to_l2_then_same_tokens_from_l2(worker, tiny_loaded) -> None:
    engine, loop, l2 = worker
    first = await loop.call(lambda e: e.generate([PROMPT], PARAMS)[0])
    hashes = engine.block_hashes(PROMPT)
    assert await loop.call(lambda e: e.cached_prefix_tokens(PROMPT)) == len(PROMPT)
    handler = CommandHandler(loop, l2)
    res = await handler.apply(cmd(Demote(hashes=[h.hex() for h in hashes], src=Tier.L1)))
    assert res.moved == 4 and res.skipped == 0
    assert await loop.call(lambda e: e.cached_prefix_tokens(PROMPT)) == 0
    assert all(h in l2 for h in hashes)
    # The next turn loads its prefix from L2 (as a prefill worker does) and must answer the same.
    blocks = [l2.get(h).to_kv_block() for h in hashes]
    assert await loop.call(lambda e: e.import_blocks(blocks)) == 4
    again = await loop.call(lambda e: e.generate([PROMPT], PARAMS)[0])
    assert again.cached_tokens == len(PROMPT) - BS  # all but the last block (its last token is recomputed)
    assert again.token_ids == first.token_ids == cold_tokens(tiny_loaded)


async def test_blocks_in_use_or_pinned_stay_in_l1(worker) -> None:
    engine, loop, l2 = worker
    await loop.call(lambda e: e.generate([PROMPT], PARAMS))
    hashes = engine.block_hashes(PROMPT)
    assert await loop.call(lambda e: e.pin(hashes[:3], time.time() + 60)) == 3
    handler = CommandHandler(loop, l2)
    res = await handler.demote(hashes, Tier.L1)
    # Only the unpinned leaf leaves; the pinned ones (held by a reference) stay where they are.
    assert res.moved == 1 and res.skipped == 3
    assert await loop.call(lambda e: e.cached_prefix_tokens(PROMPT)) == 3 * BS
    # Dropping a parent whose child is cached is refused too (leaf-first).
    assert (await handler.drop(hashes[:1], Tier.L1)).dropped == 0


async def test_l2_to_l3_then_warm_back_and_same_tokens(worker, tiny_loaded, s3_server) -> None:
    engine, loop, l2 = worker
    first = await loop.call(lambda e: e.generate([PROMPT], PARAMS)[0])
    hashes = engine.block_hashes(PROMPT)
    exported = await loop.call(lambda e: e.export_blocks(hashes))
    store = l3_store(s3_server, tiny_loaded.fingerprint, chunk_blocks=2)
    handles = store.put_chain("shared", [encode_kv_block(kb, tiny_loaded.fingerprint) for kb in exported])
    for kb in exported:
        l2.put_block(kb)
    handler = CommandHandler(loop, l2, store)
    l2.pin(hashes[0], l2.clock() + 60)
    res = await handler.apply(cmd(Demote(hashes=[h.hex() for h in hashes], src=Tier.L2)))
    assert res.moved == 3 and res.skipped == 1 and hashes[0] in l2  # the pinned one stays
    assert (await handler.apply(cmd(Drop(hashes=[h.hex() for h in hashes], tier=Tier.L1)))).dropped == 4
    assert await loop.call(lambda e: e.cached_prefix_tokens(PROMPT)) == 0
    keys = sorted({h.object_key for h in handles})
    res = await handler.apply(cmd(Warm(keys=[*keys, keys[0][:-4] + "0000"])))  # one key L3 lacks
    assert res.warmed == 3 and res.skipped == 2  # 3 came back; the pinned one was there; one chunk absent
    assert all(h in l2 for h in hashes)
    blocks = [l2.get(h).to_kv_block() for h in hashes]
    assert await loop.call(lambda e: e.import_blocks(blocks)) == 4
    again = await loop.call(lambda e: e.generate([PROMPT], PARAMS)[0])
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids == cold_tokens(tiny_loaded)


async def test_retain_prefetches_a_session_back_into_l1_and_pins_it(worker, tiny_loaded, s3_server) -> None:
    engine, loop, l2 = worker
    first = await loop.call(lambda e: e.generate([PROMPT], PARAMS)[0])
    hashes = engine.block_hashes(PROMPT)
    exported = await loop.call(lambda e: e.export_blocks(hashes))
    store = l3_store(s3_server, tiny_loaded.fingerprint, chunk_blocks=2)
    store.put_chain("shared", [encode_kv_block(kb, tiny_loaded.fingerprint) for kb in exported])
    l2.put_block(exported[0])  # the first block waits in L2, the rest only in L3
    handler = CommandHandler(loop, l2, store)
    assert (await handler.drop(hashes, Tier.L1)).dropped == 4
    assert await loop.call(lambda e: e.cached_prefix_tokens(PROMPT)) == 0
    until = time.time() + 60
    res = await handler.apply(cmd(Retain(hashes=[h.hex() for h in hashes], until=until, fetch=True)))
    assert res.prefetched == 4 and res.retained == 4 and res.skipped == 0
    assert all(h in engine.pins for h in hashes)
    # Pinned: churn that needs the whole rest of the pool does not evict the session's blocks.
    churn = [[500 + i] * (BS * 59) for i in range(2)]
    for i, prompt in enumerate(churn):
        await loop.call(lambda e, p=prompt: e.generate([p], PARAMS))
    again = await loop.call(lambda e: e.generate([PROMPT], PARAMS)[0])
    assert again.cached_tokens == len(PROMPT) - BS  # an L1 hit: the prefetched prefix
    assert again.token_ids == first.token_ids == cold_tokens(tiny_loaded)


async def test_retain_without_fetch_only_pins_what_l1_holds(worker) -> None:
    engine, loop, l2 = worker
    await loop.call(lambda e: e.generate([PROMPT], PARAMS))
    hashes = engine.block_hashes(PROMPT)
    handler = CommandHandler(loop, l2)
    assert (await handler.drop(hashes[2:], Tier.L1)).dropped == 2
    res = await handler.apply(cmd(Retain(hashes=[h.hex() for h in hashes], until=time.time() + 60)))
    assert res.retained == 2 and res.prefetched == 0 and res.skipped == 2
