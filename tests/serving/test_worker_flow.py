"""Prefill and decode workers as real processes, driven over NATS the way the ingress drives them.

One module-scoped set: prefill `pf-0`, decode `dc-0` and `dc-1` (audit rate 1.0).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from bus.helpers import FAST_BUS, connected
from kvmesh.bus.publish import Publisher
from kvmesh.kv_events.events import KVEventBatch
from kvmesh.protocol import subjects
from kvmesh.protocol.block_hash import HashKeys, hash_blocks
from kvmesh.protocol.blocks import BlockHandle, Tier
from kvmesh.protocol.serving import (
    AbortRequest,
    CachePin,
    DecodeJob,
    SamplingSpec,
)
from kvmesh.serving.audit_status import read_audit_counts
from kvmesh.serving.worker_tiers import namespace_for
from waits import taken, until

from .harness import (
    BLOCK_SIZE,
    SALT_A,
    SALT_B,
    TokenCollector,
    WorkerProcs,
    later_request,
    prefill_job,
    send,
    send_prefill,
    unique,
    worker_stack,
)

pytestmark = pytest.mark.timeout(240)

BUCKET = "kvmesh-serving-flow"


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory) -> Iterator[WorkerProcs]:
    with worker_stack(nats_server, s3_server, BUCKET, tiny_model_dir, tmp_path_factory.mktemp("serving-flow"),
                      (("prefill", "pf-"), ("decode", "dc-"), ("decode", "dc-")), audit_rate=1.0) as procs:
        yield procs



def _ids(stack: WorkerProcs) -> tuple[str, str, str]:
    pf, dc0, dc1 = list(stack.procs)[:3]
    return pf, dc0, dc1


def _prompt(reference, text: str) -> list[int]:
    return reference.tokenizer.encode(text)


async def test_two_turns_hit_previous_answer_and_match_reference(stack, nats_server, reference):
    pf, dc0, dc1 = _ids(stack)
    p1 = _prompt(reference, "The system prompt says: be brief. User: tell me about the harbour at dawn, please. " * 2)
    async with connected(nats_server.url) as nc:
        c1 = await send_prefill(nc, pf, prefill_job(unique(), p1, dc0, max_tokens=24))
        f1 = await c1.wait_final()
        out1 = c1.ordered
        assert f1.finish_reason in ("stop", "length") and f1.error is None
        assert out1 == reference(p1, 24)
        assert f1.prompt_tokens == len(p1)
        # Turn 2 extends turn 1's prompt and answer; it goes to the other decode worker.
        p2 = p1 + out1 + _prompt(reference, " User: and at night?")
        c2 = await send_prefill(nc, pf, prefill_job(unique(), p2, dc1, max_tokens=16))
        f2 = await c2.wait_final()
        assert c2.ordered == reference(p2, 16)
        computed_turn1 = len(p1) + len(out1) - 1  # the last sampled token never had its K/V computed
        assert f2.cached_tokens >= computed_turn1 // BLOCK_SIZE * BLOCK_SIZE > len(p1) // BLOCK_SIZE * BLOCK_SIZE
        assert c2.events[0].seq == 0 and c2.events[0].cached_tokens == f2.cached_tokens
        await c1.close()
        await c2.close()


async def test_concurrent_requests_batch_in_decode_and_match_reference(stack, nats_server, reference):
    pf, dc0, _ = _ids(stack)
    prompts = [_prompt(reference, f"Request number {i} shares a decode batch with its neighbours. " * (1 + i % 3))
               for i in range(5)]
    async with connected(nats_server.url) as nc:
        colls = [await send_prefill(nc, pf, prefill_job(unique(), p, dc0, max_tokens=12 + i))
                 for i, p in enumerate(prompts)]
        finals = await asyncio.gather(*(c.wait_final() for c in colls))
        for c in colls:
            await c.close()
    for i, (p, c, f) in enumerate(zip(prompts, colls, finals)):
        assert f.error is None
        assert c.ordered == reference(p, 12 + i), f"request {i} differs from the in-process engine"


async def test_workers_publish_kv_events_for_the_cache_index(stack, nats_server, reference):
    """L1 (engine), L2 and L3 changes of both workers reach KV_EVENTS, so the index can route by prefix."""
    pf, dc0, _ = _ids(stack)
    prompt = _prompt(reference, "Events tell the index which worker holds which block. " * 3)
    async with connected(nats_server.url) as nc:
        c = await send_prefill(nc, pf, prefill_job(unique(), prompt, dc0, max_tokens=8))
        await c.wait_final()
        await c.close()
        js = nc.jetstream()
        prompt_hashes = None
        for worker, tiers in ((pf, {"L1", "L2", "L3"}), (dc0, {"L1", "L2"})):
            seen: dict[str, set[str]] = {}
            end = time.monotonic() + 20
            while time.monotonic() < end and not tiers <= set(seen):
                sub = await js.subscribe(subjects.kv_events(worker), ordered_consumer=True)
                try:
                    while True:
                        msg = await sub.next_msg(timeout=0.5)
                        for ev in KVEventBatch.from_bytes(msg.data).events:
                            if ev.kind == "stored":
                                seen.setdefault(ev.tier.value, set()).update(ev.hashes)
                except TimeoutError:
                    pass
                finally:
                    await sub.unsubscribe()
            assert tiers <= set(seen), f"{worker}: stored events only for {sorted(seen)}"
            prompt_hashes = prompt_hashes or seen
        assert prompt_hashes["L1"] & prompt_hashes["L2"]


async def test_seeded_sampling_through_prefill_and_decode_matches_reference(stack, nats_server, reference):
    pf, dc0, _ = _ids(stack)
    prompt = _prompt(reference, "Sampling with a seed gives the same answer through the services as in process.")
    spec = SamplingSpec(max_tokens=14, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True)
    job = prefill_job(unique(), prompt, dc0, 14).model_copy(update={"sampling": spec})
    async with connected(nats_server.url) as nc:
        c = await send_prefill(nc, pf, job)
        await c.wait_final()
        await c.close()
    assert c.ordered == reference(prompt, 14, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True)


async def test_first_token_can_finish_at_prefill(stack, nats_server, reference):
    pf, dc0, _ = _ids(stack)
    prompt = _prompt(reference, "One token only, please.")
    async with connected(nats_server.url) as nc:
        c = await send_prefill(nc, pf, prefill_job(unique(), prompt, dc0, max_tokens=1))
        final = await c.wait_final()
        assert len(c.events) == 1 and final.seq == 0 and final.finish_reason == "length"
        assert c.ordered == reference(prompt, 1)
        assert final.worker_id == pf


async def test_redelivered_job_runs_once(stack, nats_server, reference):
    pf, dc0, _ = _ids(stack)
    prompt = _prompt(reference, "Say it once and only once, even if the job comes twice.")
    job = prefill_job(unique(), prompt, dc0, max_tokens=8)
    async with connected(nats_server.url) as nc:
        c = await TokenCollector(job.request_id).subscribe(nc)
        pub = Publisher(nc.jetstream(), FAST_BUS)
        # Two deliveries of the same (request, attempt) under different stream ids: what a redelivery looks like.
        await pub.publish(subjects.jobs_prefill(pf), job, msg_id=f"{job.request_id}:a")
        await pub.publish(subjects.jobs_prefill(pf), job, msg_id=f"{job.request_id}:b")
        await c.wait_final()
        # A second run would show up as more events: a later, longer request through the same two
        # workers is over after anything such a run sent.
        await later_request(nc, pf, dc0)
        await taken(nc, c)
        assert c.dropped == 0
        assert sum(1 for e in c.events if e.finished) == 1
        assert c.ordered == reference(prompt, 8)


async def test_migration_without_reachable_blocks_recomputes(stack, nats_server, reference):
    _, _, dc1 = _ids(stack)
    prompt = _prompt(reference, "A request that moves to another decode worker halfway through its answer.")
    full = reference(prompt, 20)
    rid = unique()
    job = DecodeJob(request_id=rid, attempt=1, tenant="t", tenant_salt=SALT_B, prompt_ids=prompt, generated=full[:7],
                    sampling=SamplingSpec(max_tokens=20), handles=[], prompt_tokens=len(prompt), deadline=time.time() + 60)
    async with connected(nats_server.url) as nc:
        c = await send(nc, subjects.jobs_decode(dc1), job)
        final = await c.wait_final()
        assert min(e.seq for e in c.events) == 7
        assert [c.tokens[s] for s in range(7, 20)] == full[7:]
        assert final.finish_reason == "length"


async def test_migration_with_every_token_delivered_only_finishes(stack, nats_server, reference):
    """The first decode worker's final event was lost after its last token: the migrated attempt sends
    one final event with no token at seq max_tokens, finish reason length (nothing is generated again)."""
    _, _, dc1 = _ids(stack)
    prompt = _prompt(reference, "Every token of this answer reached the client; only its end went missing.")
    full = reference(prompt, 12)
    rid = unique()
    job = DecodeJob(request_id=rid, attempt=1, tenant="t", tenant_salt=SALT_B, prompt_ids=prompt, generated=full,
                    sampling=SamplingSpec(max_tokens=12), handles=[], prompt_tokens=len(prompt),
                    deadline=time.time() + 60)
    async with connected(nats_server.url) as nc:
        c = await send(nc, subjects.jobs_decode(dc1), job)
        final = await c.wait_final()
        await c.close()
    assert len(full) == 12 and final.error is None and final.finish_reason == "length"
    assert [(e.seq, e.token_ids, e.finished) for e in c.events] == [(12, [], True)]


async def test_tenants_never_share_blocks(stack, nats_server, reference):
    pf, dc0, _ = _ids(stack)
    prompt = _prompt(reference, "Identical words from two tenants must never share one cached block. " * 2)
    async with connected(nats_server.url) as nc:
        ca = await send_prefill(nc, pf, prefill_job(unique(), prompt, dc0, max_tokens=4, salt=SALT_A))
        fa = await ca.wait_final()
        ca2 = await send_prefill(nc, pf, prefill_job(unique(), prompt, dc0, max_tokens=4, salt=SALT_A))
        fa2 = await ca2.wait_final()
        cb = await send_prefill(nc, pf, prefill_job(unique(), prompt, dc0, max_tokens=4, salt=SALT_B))
        fb = await cb.wait_final()
    assert fa.cached_tokens == 0
    assert fa2.cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the same tenant hits
    assert fb.cached_tokens == 0  # the other tenant does not
    assert ca.ordered == ca2.ordered == cb.ordered


async def test_named_cache_is_written_to_l3_and_reports_creation(stack, nats_server, s3_server, reference):
    pf, dc0, _ = _ids(stack)
    salt = unique("").ljust(64, "0")[:64]
    salt = "".join(ch if ch in "0123456789abcdef" else "0" for ch in salt)
    prompt = _prompt(reference, "A long shared system prompt that a named cache keeps for a week. " * 3)
    pinned = len(prompt)
    async with connected(nats_server.url) as nc:
        c = await send_prefill(nc, pf, prefill_job(unique(), prompt, dc0, max_tokens=1, salt=salt, prefill_only=True,
                                                   pins=[CachePin(num_tokens=pinned, ttl_s=7 * 24 * 3600.0)]))
        final = await c.wait_final()
    assert final.finished and final.finish_reason == "stop" and final.token_ids == []
    assert final.cache_created_tokens == len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    objects = list(s3_server.client().list_objects(BUCKET, recursive=True))
    ours = [o for o in objects if f"/{namespace_for(salt)}/" in o.object_name]
    assert ours, "the named cache's blocks are in L3 once the final event is out"
    meta = s3_server.client().stat_object(BUCKET, ours[0].object_name).metadata
    assert any(v == str(7 * 24 * 3600) for k, v in meta.items() if k.lower().endswith("ttl-s"))


async def test_named_cache_is_reached_from_l3_by_a_fresh_worker(stack, nats_server, reference):
    """A prefill worker with an empty pool and no peers to probe finds a named cache's blocks in L3."""
    _, dc0, _ = _ids(stack)
    salt = "c3" * 32
    prefix = _prompt(reference, "Durable instructions kept in object storage for a long time. " * 3)
    fresh = stack.start("prefill", unique("pf-l3-"), KVMESH_WORKERS__PROBE_PEERS="false")
    async with connected(nats_server.url) as nc:
        pinning = prefill_job(unique(), prefix, dc0, max_tokens=1, salt=salt, prefill_only=True,
                              pins=[CachePin(num_tokens=len(prefix), ttl_s=3600.0)])
        c = await send_prefill(nc, list(stack.procs)[0], pinning)
        assert (await c.wait_final()).error is None
        stack.wait_ready([fresh])
        # Longer than the cached prefix by more than a block: its L3 chunk is found by a shorter key.
        prompt = prefix + _prompt(reference, " Question: what now, and after that, and then what else after it?")
        assert (len(prompt) - 1) // BLOCK_SIZE > len(prefix) // BLOCK_SIZE
        c2 = await send_prefill(nc, fresh.worker_id, prefill_job(unique(), prompt, dc0, max_tokens=6, salt=salt))
        final = await c2.wait_final()
    assert final.cached_tokens >= len(prefix) // BLOCK_SIZE * BLOCK_SIZE
    assert c2.events[0].worker_id == fresh.worker_id
    assert c2.ordered == reference(prompt, 6)


async def test_decode_falls_back_to_l3_when_handles_do_not_resolve(stack, nats_server, reference):
    """Handles naming a worker that is gone: the decode worker finds the chain in L3 by its chunk keys."""
    pf, _, dc1 = _ids(stack)
    salt = "d4" * 32
    prompt = _prompt(reference, "Blocks whose owner vanished are still in object storage. " * 3)
    hashes = hash_blocks(prompt, BLOCK_SIZE, HashKeys(reference.fingerprint, bytes.fromhex(salt)))
    handles = [BlockHandle(block_hash=h.hex(), tier=Tier.L2, worker_id="gone-worker", size=1, checksum="00")
               for h in hashes]
    expected = reference(prompt, 8)
    rid = unique()
    async with connected(nats_server.url) as nc:
        c = await send_prefill(nc, pf, prefill_job(unique(), prompt, dc1, max_tokens=1, salt=salt, prefill_only=True,
                                                   pins=[CachePin(num_tokens=len(prompt), ttl_s=600.0)]))
        assert (await c.wait_final()).error is None  # the chain is in L3 now
        job = DecodeJob(request_id=rid, tenant="t", tenant_salt=salt, prompt_ids=prompt, generated=expected[:1],
                        sampling=SamplingSpec(max_tokens=8), handles=handles, prompt_tokens=len(prompt),
                        deadline=time.time() + 60)
        d = await send(nc, subjects.handoff(dc1), job)
        await d.wait_final()
    assert [d.tokens[i] for i in range(1, 8)] == expected[1:]

    def decoded() -> list[dict]:
        return [json.loads(line) for line in stack.procs[dc1].proc.log_path.read_text().splitlines()
                if rid in line and '"decoded"' in line]
    logged = await until(decoded, 10, f"{dc1}'s decoded log line (written right after its final event)")
    assert logged[0]["sources"].get("L3") == len(hashes)


async def test_deadline_passed_is_an_error_event(stack, nats_server, reference):
    pf, dc0, _ = _ids(stack)
    async with connected(nats_server.url) as nc:
        c = await send_prefill(nc, pf, prefill_job(unique(), [5, 6, 7], dc0, max_tokens=4, deadline_s=-1.0))
        final = await c.wait_final()
    assert final.finish_reason == "error" and final.retriable and final.token_ids == []


async def test_cache_audit_counts_hits_without_mismatch(stack, nats_server, reference):
    pf, dc0, dc1 = _ids(stack)

    def audited() -> float:
        return stack.metric(dc0, "kvmesh_cache_audit_total") + stack.metric(dc1, "kvmesh_cache_audit_total")

    before = audited()
    prompt = _prompt(reference, "Audit me: the cold recompute must give the same tokens as the cached path. " * 2)
    async with connected(nats_server.url) as nc:
        for worker in (dc0, dc1, dc0):  # every one reuses KV (handed-off blocks, then prefill hits)
            c = await send_prefill(nc, pf, prefill_job(unique(), prompt, worker, max_tokens=10))
            await c.wait_final()
            await c.close()
    await until(lambda: audited() >= before + 3, 60, "three more cache audits", poll_s=0.3)
    assert stack.metric(dc0, "kvmesh_cache_audit_mismatch_total") == 0
    assert stack.metric(dc1, "kvmesh_cache_audit_mismatch_total") == 0
    # What `kvmesh status` reads (endpoints named like the stack names decode replicas).
    counts = read_audit_counts([(f"decode-{i}", stack.procs[w].http_endpoint) for i, w in enumerate((dc0, dc1))])
    assert counts.workers_read == 2 and counts.audited >= before + 3 and counts.mismatches == 0


async def test_abort_stops_the_stream_without_a_final_event(stack, nats_server, reference):
    pf, dc0, _ = _ids(stack)
    prompt = _prompt(reference, "The client hangs up while this long answer streams.")
    job = prefill_job(unique(), prompt, dc0, max_tokens=400)
    job = job.model_copy(update={"sampling": SamplingSpec(max_tokens=400, ignore_eos=True)})
    async with connected(nats_server.url) as nc:
        c = await send_prefill(nc, pf, job)
        await until(lambda: len(c.ordered) >= 4, 60, "the first tokens of the request", poll_s=0.01)
        await nc.publish(subjects.abort(dc0), AbortRequest(request_id=job.request_id).to_bytes())
        # A later request through dc0 (which took the abort first) is over after every event sent
        # before the abort took hold; while a second one decodes, a request still running would stream on.
        await later_request(nc, pf, dc0)
        await taken(nc, c)
        stopped = len(c.events)
        await later_request(nc, pf, dc0)
        await taken(nc, c)
        assert len(c.events) == stopped, "the aborted request went on streaming"
        assert c.final is None, "a final event came although the request was aborted"
        await c.close()
    assert len(c.ordered) < 400
