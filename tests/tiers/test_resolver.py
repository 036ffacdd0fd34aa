"""Handle resolution follows the tier order L1 -> L2 -> peer -> L3, and what it returns is transparent."""

from __future__ import annotations

import uuid

import torch
from fastapi import FastAPI
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.sampling import SamplingParams
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import MissCounters, MissReason
from kvmesh.tiers.resolver import EngineL1, Resolver
from kvmesh.tiers.s3_client import fast_fail_client
from kvmesh.transfer.peer_http import HttpPeerClient, peer_router, serve_in_loop

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)


def _engine(loaded) -> Engine:
    return Engine(loaded, EngineSettings(block_size=8, num_blocks=64))


async def test_resolution_order_and_transparency(tiny_loaded, s3_server) -> None:
    fp = tiny_loaded.fingerprint
    src = _engine(tiny_loaded)
    prompt = tiny_loaded.tokenizer.encode("The tiers are tried in order: own pool, own host memory, a peer, then S3.")
    ref = src.generate([prompt], GREEDY)[0].token_ids
    hashes = src.block_hashes(prompt)
    blocks = src.export_blocks(hashes)
    assert len(blocks) >= 3

    counters = MissCounters()
    own_l2 = HostTier(1 << 26, LRUPolicy(), fp, "me", counters=counters)
    peer_l2 = HostTier(1 << 26, LRUPolicy(), fp, "peer", counters=MissCounters())
    client = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    l3 = L3Store(client, f"t-{uuid.uuid4().hex[:12]}", fp, chunk_blocks=2, counters=counters)
    l3.ensure_bucket()
    encoded = [encode_kv_block(b, fp) for b in blocks]
    l3_handles = l3.put_chain("ns", encoded)
    for b in blocks:
        own_l2.put_block(b)
        peer_l2.put_block(b)
    # What prefill would hand over: the peer owns it in L2, and it is in L3 as well.
    handles = [h.model_copy(update={"worker_id": "peer"}) for h in l3_handles]

    app = FastAPI()
    app.include_router(peer_router(peer_l2))
    async with serve_in_loop(app) as url:
        peers = HttpPeerClient(lambda worker: url, fp, counters)
        fresh = _engine(tiny_loaded)
        resolver = Resolver("me", EngineL1(src), own_l2, peers, l3, counters)
        r = await resolver.resolve(handles[0])
        assert r.tier is Tier.L1 and r.misses == []

        resolver.l1 = EngineL1(fresh)  # empty pool: the next tiers in turn
        r = await resolver.resolve(handles[0])
        assert r.tier is Tier.L2 and [m.tier for m in r.misses] == [Tier.L1]
        own_l2.remove(blocks[0].block_hash)
        r = await resolver.resolve(handles[0])
        assert r.tier is Tier.PEER and [m.tier for m in r.misses] == [Tier.L1, Tier.L2]
        peer_l2.remove(blocks[0].block_hash)
        r = await resolver.resolve(handles[0])
        assert r.tier is Tier.L3 and [(m.tier, m.reason) for m in r.misses] == [
            (Tier.L1, MissReason.NOT_FOUND), (Tier.L2, MissReason.NOT_FOUND), (Tier.PEER, MissReason.NOT_FOUND)]
        assert torch.equal(r.block.data, blocks[0].data)

        # Cache transparency: a fresh engine fed from the tiers answers like the one that computed.
        resolved = [(await resolver.resolve(h)).block for h in handles]
        assert fresh.import_blocks(resolved) == len(blocks)
        out = fresh.generate([prompt], GREEDY)[0]
        assert out.token_ids == ref and out.cached_tokens >= len(blocks) * 8 - 8

        l3.client.remove_object(l3.bucket, handles[0].object_key)
        r = await Resolver("me", EngineL1(_engine(tiny_loaded)), own_l2, peers, l3, counters).resolve(handles[0])
        assert r.block is None and [m.tier for m in r.misses] == [Tier.L1, Tier.L2, Tier.PEER, Tier.L3]
        assert counters.get(Tier.L3, MissReason.NOT_FOUND) == 1
        await peers.close()
