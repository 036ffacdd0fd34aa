"""Per-tier metrics move as they should on a scripted workload, on real worker processes.

One prefill worker (peer probing off, so a block comes from its own tiers
only) and one decode worker on the session NATS / S3 servers. One tenant's
prompt is served four times: cold, from L1, from L2 (its L1 copy dropped by
an eviction command), from L3 (L1 and L2 dropped, after the upload landed).
Each time the prefill worker's /metrics must move by exactly the prompt's
block count at the tier it came from, and the tokens must equal the
reference (cache transparency).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from bus.helpers import FAST_BUS, connected
from kvmesh.bus.publish import Publisher
from kvmesh.eviction.messages import Drop, WorkerCommand
from kvmesh.protocol import subjects
from kvmesh.protocol.block_hash import HashKeys, hash_blocks
from kvmesh.protocol.blocks import Tier
from prometheus_client.parser import text_string_to_metric_families

from .harness import (
    BLOCK_SIZE,
    WorkerProcs,
    prefill_job,
    send_prefill,
    unique,
    worker_stack,
)

pytestmark = pytest.mark.timeout(300)

BUCKET = "kvmesh-tier-metrics"
SALT = "5e" * 32
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory) -> Iterator[WorkerProcs]:
    # Peers off: a block comes from this worker's own tiers. A short tail delay: the chain's last chunk lands soon.
    with worker_stack(nats_server, s3_server, BUCKET, tiny_model_dir, tmp_path_factory.mktemp("tier-metrics"),
                      KVMESH_WORKERS__PROBE_PEERS="false", KVMESH_TIERS__L3_TAIL_DELAY_S="0.1") as procs:
        yield procs



class Scrape:
    """One /metrics scrape: `value(name, **labels)` sums the samples whose labels include those given."""

    def __init__(self, stack: WorkerProcs, worker_id: str) -> None:
        text = httpx.get(f"{stack.procs[worker_id].http_endpoint}/metrics", timeout=5).text
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _delta(after: Scrape, before: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


async def _serve(nc, stack: WorkerProcs, prompt: list[int]) -> list[int]:
    pf, dc = list(stack.procs)
    job = prefill_job(unique(), prompt, dc, max_tokens=MAX_TOKENS, salt=SALT)
    coll = await send_prefill(nc, pf, job)
    final = await coll.wait_final()
    await coll.close()
    assert final.error is None, final.error
    return coll.ordered


async def _drop(nc, stack: WorkerProcs, hashes: list[bytes], tier: Tier) -> None:
    """Send the prefill worker an eviction command dropping `hashes` from `tier`; wait until it applied it."""
    pf = list(stack.procs)[0]
    before = Scrape(stack, pf).value("kvmesh_worker_command_blocks_total", action="dropped")
    cmd = WorkerCommand(worker=pf, command_id=unique("drop-"),
                        command=Drop(hashes=[h.hex() for h in reversed(hashes)], tier=tier))
    await Publisher(nc.jetstream(), FAST_BUS).publish(subjects.commands(pf), cmd, msg_id=cmd.command_id)
    await _until(lambda: Scrape(stack, pf).value("kvmesh_worker_command_blocks_total", action="dropped")
                 >= before + len(hashes), f"{len(hashes)} blocks dropped from {tier.value}")


async def _until(check, what: str, timeout_s: float = 60.0, detail=None) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"not seen within {timeout_s}s: {what}: {detail() if detail else ''}")
        await asyncio.sleep(0.1)


async def test_hits_move_at_the_tier_each_block_came_from(stack, nats_server, reference, tiny_loaded):
    pf, dc = list(stack.procs)
    # 20 full blocks and a partial one: one full L3 chunk (16 blocks) and a tail; every full block is usable.
    prompt = [(7 * i + 3) % 200 + 10 for i in range(20 * BLOCK_SIZE + 5)]
    blocks = (len(prompt) - 1) // BLOCK_SIZE
    assert blocks == len(prompt) // BLOCK_SIZE == 20
    hashes = hash_blocks(prompt, BLOCK_SIZE, HashKeys(reference.fingerprint, bytes.fromhex(SALT)))
    expected = reference(prompt, MAX_TOKENS)
    block_bytes = tiny_loaded.config.kv_bytes_per_token() * BLOCK_SIZE
    hit, miss = "kvmesh_kv_hit_blocks_total", "kvmesh_kv_miss_blocks_total"

    async with connected(nats_server.url) as nc:
        # 1. cold: every block is a miss, nothing hits; decode resolves the handed-off blocks once each.
        s0, d0 = Scrape(stack, pf), Scrape(stack, dc)
        assert await _serve(nc, stack, prompt) == expected
        s1, d1 = Scrape(stack, pf), Scrape(stack, dc)
        assert _delta(s1, s0, miss, stage="prefill") == blocks
        assert _delta(s1, s0, hit, stage="prefill") == 0
        assert _delta(s1, s0, "kvmesh_prefix_cache_queries_total") == blocks * BLOCK_SIZE
        assert _delta(d1, d0, hit, stage="decode") + _delta(d1, d0, miss, stage="decode") == blocks

        # 2. the same prompt again: L1 hits rise by exactly its block count, nothing else moves.
        assert await _serve(nc, stack, prompt) == expected
        s2 = Scrape(stack, pf)
        assert _delta(s2, s1, hit, stage="prefill", tier="l1") == blocks
        assert _delta(s2, s1, hit, stage="prefill") == blocks
        assert _delta(s2, s1, miss, stage="prefill") == 0
        assert _delta(s2, s1, "kvmesh_kv_hit_bytes_total", stage="prefill", tier="l1") == blocks * block_bytes
        assert _delta(s2, s1, "kvmesh_prefix_cache_hits_total", tier="l1") == blocks * BLOCK_SIZE

        # The prefill stored the chain in its L2 and queued it for L3: both chunks land (the tail after its delay),
        # each PUT by this worker or found there by its HEAD (the decode worker uploads the same chain too).
        def landed(scrape: Scrape) -> float:
            return sum(scrape.value("kvmesh_l3_upload_chunks_total", outcome=o) for o in ("written", "existing"))

        await _until(lambda: landed(Scrape(stack, pf)) >= 2, "the prompt's two chunks landed in L3", 60,
                     lambda: [(x.name, x.labels, x.value) for x in Scrape(stack, pf).samples if "_l3_" in x.name])
        up, dup = Scrape(stack, pf), Scrape(stack, dc)
        assert _delta(up, s0, "kvmesh_l3_upload_chunks_total", outcome="submitted") >= 2
        assert up.value("kvmesh_l3_upload_chunks_total", outcome="dropped") == 0
        put = _delta(up, s0, "kvmesh_l3_put_bytes_total") + _delta(dup, d0, "kvmesh_l3_put_bytes_total")
        assert put >= blocks * block_bytes  # every block went into some object once (plus headers)

        # 3. L1 dropped: the chain comes back from this worker's L2, and its restore time is observed.
        await _drop(nc, stack, hashes, Tier.L1)
        s3 = Scrape(stack, pf)
        assert await _serve(nc, stack, prompt) == expected
        s4 = Scrape(stack, pf)
        assert _delta(s4, s3, hit, stage="prefill", tier="l2") == blocks
        assert _delta(s4, s3, hit, stage="prefill", tier="l1") == 0
        assert _delta(s4, s3, miss, stage="prefill") == 0
        assert _delta(s4, s3, "kvmesh_kv_restore_seconds_count", stage="prefill", tier="l2") == 1

        # 4. L1 and L2 dropped: the chain comes back from L3.
        await _drop(nc, stack, hashes, Tier.L1)
        await _drop(nc, stack, hashes, Tier.L2)
        s5 = Scrape(stack, pf)
        assert await _serve(nc, stack, prompt) == expected
        s6 = Scrape(stack, pf)
        assert _delta(s6, s5, hit, stage="prefill", tier="l3") == blocks
        assert _delta(s6, s5, hit, stage="prefill") == blocks
        assert _delta(s6, s5, miss, stage="prefill") == 0
        assert _delta(s6, s5, "kvmesh_kv_hit_bytes_total", stage="prefill", tier="l3") == blocks * block_bytes
        assert _delta(s6, s5, "kvmesh_kv_restore_seconds_count", stage="prefill", tier="l3") == 1
