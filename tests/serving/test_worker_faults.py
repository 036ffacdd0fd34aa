"""Faults around the workers, with the test playing the ingress's supervision.

Module-scoped: prefill `pf-a`, `pf-b` and decode `dc-a`, `dc-b`; each test
SIGKILLs its own victim (`dc-b`, then `pf-b`), the survivors finish the work.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from bus.helpers import FAST_BUS, connected
from kvmesh.bus.publish import Publisher
from kvmesh.protocol import subjects
from kvmesh.protocol.serving import DecodeJob, SamplingSpec
from kvmesh.protocol.streams import JOBS
from waits import WorkerWatch, taken, until

from .harness import (
    TokenCollector,
    WorkerProc,
    WorkerProcs,
    later_request,
    prefill_job,
    unique,
    worker_stack,
)

pytestmark = pytest.mark.timeout(240)

BUCKET = "kvmesh-serving-faults"
WORKERS = (("prefill", "pf-a"), ("prefill", "pf-b"), ("decode", "dc-a"), ("decode", "dc-b"))  # (role, key)


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory) -> Iterator[dict[str, str]]:
    """Each key of WORKERS -> its worker's id, and "procs"."""
    with worker_stack(nats_server, s3_server, BUCKET, tiny_model_dir, tmp_path_factory.mktemp("serving-faults"),
                      [(role, key + "-") for role, key in WORKERS]) as procs:
        started = list(procs.procs)  # in the order of WORKERS
        yield {**{key: worker_id for (_, key), worker_id in zip(WORKERS, started)}, "procs": procs}



def _prompt(reference, text: str) -> list[int]:
    return reference.tokenizer.encode(text)


def _jobs_taken(wp: WorkerProc) -> float:
    """Jobs `wp` has taken off its queues: being handled now, or handled (its consumer's metrics)."""
    text = httpx.get(f"{wp.http_endpoint}/metrics", timeout=5).text
    # One series per consumer, labelled with its filter subject: the worker's own queue and the shared one.
    series = r'^kvmesh_messages_(?:in_flight|handled_total)\{subject="kvmesh\.jobs\.prefill\.[^"]+"\} (\S+)$'
    return sum(float(v) for v in re.findall(series, text, re.MULTILINE))


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
        victim = await WorkerWatch.up(nc.jetstream(), stack["dc-b"])
        await pub.publish(subjects.jobs_prefill(stack["pf-a"]), job, msg_id=f"{job.request_id}:0")
        await until(lambda: len(c.ordered) >= 8 or c.final, 60, "decode streaming 8 tokens", poll_s=0.01)
        assert c.final is None, "decode did not start streaming"
        procs.procs[stack["dc-b"]].kill()
        # Seen down (its heartbeat expired) as the ingress sees it: by then all it sent has arrived.
        await victim.down()
        await taken(nc, c)
        assert c.final is None, "the stream ended although its worker was killed"
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
    job = prefill_job(unique(), prompt, stack["dc-a"], 12)
    dead = subjects.jobs_prefill(stack["pf-b"])
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        pub = Publisher(js, FAST_BUS)
        c = await TokenCollector(job.request_id).subscribe(nc)
        victim = await WorkerWatch.up(js, stack["pf-b"])
        procs.procs[stack["pf-b"]].kill()
        await pub.publish(dead, job, msg_id=f"{job.request_id}:0")
        await victim.down()  # what makes the ingress retry on another worker
        retry = job.model_copy(update={"attempt": 1})
        await pub.publish(subjects.jobs_prefill(stack["pf-a"]), retry, msg_id=f"{job.request_id}:1")
        final = await c.wait_final(60)
        await taken(nc, c)
        # The dead worker's job is still in its queue, taken by no one, and every event is the retry's.
        assert (await js.stream_info(JOBS.name, subjects_filter=dead)).state.subjects == {dead: 1}
        assert all(e.attempt == 1 for e in c.events), "a dead worker produced tokens"
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
        gone = await WorkerWatch.up(nc.jetstream(), victim.worker_id)
        await pub.publish(subjects.jobs_prefill(victim.worker_id), job, msg_id=f"{job.request_id}:0")
        await until(lambda: _jobs_taken(victim) >= 1, 30, "the victim taking the job", poll_s=0.02)
        victim.kill()
        await gone.down()  # all it sent before it died has arrived
        await taken(nc, c)
        if c.final is None:  # not finished by attempt 0: retry elsewhere
            await pub.publish(subjects.jobs_prefill(stack["pf-a"]), job.model_copy(update={"attempt": 1}),
                              msg_id=f"{job.request_id}:1")
        await c.wait_final(60)
        # Late events of either attempt come from pf-a and dc-a: a later, longer request through them
        # is over after the last of those.
        await later_request(nc, stack["pf-a"], stack["dc-a"])
        await taken(nc, c)
        await c.close()
    assert c.ordered == expected
    seen: dict[int, int] = {}
    for e in c.events:  # every event, whichever attempt sent it, agrees with the reference at its seqs
        for i, tok in enumerate(e.token_ids):
            seen.setdefault(e.seq + i, tok)
            assert tok == expected[e.seq + i]
