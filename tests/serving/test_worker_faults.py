"""Faults around the workers, with the test playing the ingress's supervision.

Module-scoped: prefill `pf-a`, `pf-b` and decode `dc-a`, `dc-b`; each test
SIGKILLs its own victim (`dc-b`, then `pf-b`), the survivors finish the work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from bus.helpers import FAST_BUS, connected

from shared.bus.publish import Publisher
from shared.protocol import subjects
from shared.protocol.serving import DecodeJob, SamplingSpec

from .harness import TokenCollector, WorkerProcs, declare_streams, prefill_job, unique, worker_env

pytestmark = pytest.mark.timeout(240)

BUCKET = "kvmesh-serving-faults"
SILENCE_S = 1.5  # the ingress's inter-token timeout, short for the test


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory) -> Iterator[dict[str, str]]:
    declare_streams(nats_server.url)
    s3_server.ensure_bucket(BUCKET)
    state = tmp_path_factory.mktemp("serving-faults")
    procs = WorkerProcs(worker_env(nats_server.url, s3_server, BUCKET, tiny_model_dir, state), state / "logs")
    names = {}
    try:
        for role, key in (("prefill", "pf-a"), ("prefill", "pf-b"), ("decode", "dc-a"), ("decode", "dc-b")):
            names[key] = procs.start(role, unique(key + "-")).worker_id
        procs.wait_ready()
        yield {**names, "procs": procs}
    finally:
        procs.stop_all()



def _prompt(reference, text: str) -> list[int]:
    return reference.tokenizer.encode(text)


async def test_decode_killed_mid_stream_migrates_without_gap_or_duplicate(stack, nats_server, reference):
    procs: WorkerProcs = stack["procs"]
    prompt = _prompt(reference, "A long answer is being streamed when its decode worker dies without warning. " * 2)
    max_tokens = 160
    expected = reference(prompt, max_tokens, ignore_eos=True)
    job = prefill_job(unique(), prompt, stack["dc-b"], max_tokens)
    job = job.model_copy(update={"sampling": SamplingSpec(max_tokens=max_tokens, ignore_eos=True)})
    async with connected(nats_server.url) as nc:
        pub = Publisher(nc.jetstream(), FAST_BUS)
        c = await TokenCollector(job.request_id).subscribe(nc)
        await pub.publish(subjects.jobs_prefill(stack["pf-a"]), job, msg_id=f"{job.request_id}:0")
        end = time.monotonic() + 60
        while len(c.ordered) < 8:
            assert time.monotonic() < end and c.final is None, "decode did not start streaming"
            await asyncio.sleep(0.01)
        procs.procs[stack["dc-b"]].kill()
        assert await c.wait_silence(SILENCE_S, timeout_s=30), "the stream ended although its worker was killed"
        delivered = c.ordered
        assert 8 <= len(delivered) < max_tokens
        migration = DecodeJob(request_id=job.request_id, attempt=1, tenant=job.tenant, tenant_salt=job.tenant_salt,
                              prompt_ids=prompt, generated=delivered, sampling=job.sampling,
                              prompt_tokens=len(prompt), deadline=job.deadline)
        await pub.publish(subjects.jobs_decode(stack["dc-a"]), migration, msg_id=f"{job.request_id}:1")
        final = await c.wait_final(60)
        await c.close()
    assert final.finish_reason == "length" and final.attempt == 1 and final.worker_id == stack["dc-a"]
    assert c.ordered == expected
    assert min(e.seq for e in c.events if e.attempt == 1) == len(delivered)


async def test_prefill_dead_before_handoff_is_retried_on_another(stack, nats_server, reference):
    procs: WorkerProcs = stack["procs"]
    prompt = _prompt(reference, "This job was addressed to a prefill worker that is gone. " * 2)
    expected = reference(prompt, 12)
    procs.procs[stack["pf-b"]].kill()
    job = prefill_job(unique(), prompt, stack["dc-a"], 12)
    async with connected(nats_server.url) as nc:
        pub = Publisher(nc.jetstream(), FAST_BUS)
        c = await TokenCollector(job.request_id).subscribe(nc)
        await pub.publish(subjects.jobs_prefill(stack["pf-b"]), job, msg_id=f"{job.request_id}:0")
        assert await c.wait_silence(SILENCE_S, timeout_s=30)
        assert not c.events, "a dead worker produced tokens"
        retry = job.model_copy(update={"attempt": 1})
        await pub.publish(subjects.jobs_prefill(stack["pf-a"]), retry, msg_id=f"{job.request_id}:1")
        final = await c.wait_final(60)
        await c.close()
    assert final.attempt == 1 and final.finish_reason in ("stop", "length")
    assert c.ordered == expected
    assert c.events[0].worker_id == stack["pf-a"]


async def test_prefill_killed_while_working_duplicates_are_droppable(stack, nats_server, reference):
    """A prefill killed around its handoff: whatever its attempt sent, the retry's events reuse the same seqs."""
    procs: WorkerProcs = stack["procs"]
    victim = procs.start("prefill", unique("pf-c-"))
    procs.wait_ready([victim])
    prompt = _prompt(reference, "Killed at an unknown point of its work, the first attempt may or may not hand off. " * 3)
    expected = reference(prompt, 10)
    job = prefill_job(unique(), prompt, stack["dc-a"], 10)
    async with connected(nats_server.url) as nc:
        pub = Publisher(nc.jetstream(), FAST_BUS)
        c = await TokenCollector(job.request_id).subscribe(nc)
        await pub.publish(subjects.jobs_prefill(victim.worker_id), job, msg_id=f"{job.request_id}:0")
        await asyncio.sleep(0.3)
        victim.kill()
        if await c.wait_silence(SILENCE_S, timeout_s=30):  # not finished by attempt 0: retry elsewhere
            await pub.publish(subjects.jobs_prefill(stack["pf-a"]), job.model_copy(update={"attempt": 1}),
                              msg_id=f"{job.request_id}:1")
        await c.wait_final(60)
        await asyncio.sleep(0.5)  # late events of either attempt
        await c.close()
    assert c.ordered == expected
    seen: dict[int, int] = {}
    for e in c.events:  # every event, whichever attempt sent it, agrees with the reference at its seqs
        for i, tok in enumerate(e.token_ids):
            seen.setdefault(e.seq + i, tok)
            assert tok == expected[e.seq + i]
