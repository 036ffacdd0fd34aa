"""A request whose PrefillJob names its own prefill worker for decode runs to its end there.

Real processes: prefill `pf-` and decode `dc-` on the session's NATS and S3. A request decoded on
its prefill worker gives the same tokens as one handed off (and as the in-process reference), its
next turn finds the whole previous answer in that worker's pool, and one migrated away mid-stream
(the ingress fences the old attempt and hands the rest to a decode worker) still ends exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from bus.helpers import connected
from kvmesh.protocol import subjects
from kvmesh.protocol.serving import AbortRequest, DecodeJob, SamplingSpec
from waits import taken, until

from .harness import (
    BLOCK_SIZE,
    SALT_A,
    WorkerProcs,
    later_request,
    prefill_job,
    send,
    send_prefill,
    unique,
    worker_stack,
)

pytestmark = pytest.mark.timeout(240)

BUCKET = "kvmesh-local-decode"


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory) -> Iterator[WorkerProcs]:
    with worker_stack(nats_server, s3_server, BUCKET, tiny_model_dir, tmp_path_factory.mktemp("local-decode"),
                      (("prefill", "pf-"), ("decode", "dc-"))) as procs:
        yield procs


def _ids(stack: WorkerProcs) -> tuple[str, str]:
    pf, dc = list(stack.procs)[:2]
    return pf, dc


def _logged(stack: WorkerProcs, worker: str, rid: str, event: str) -> list[dict]:
    return [json.loads(line) for line in stack.procs[worker].proc.log_path.read_text().splitlines()
            if rid in line and f'"{event}"' in line]


async def test_decoded_here_equals_handed_off_and_next_turn_hits_the_answer(stack, nats_server, reference):
    pf, dc = _ids(stack)
    prompt = reference.tokenizer.encode("Local decode: the prompt stays where it was computed, and so does its answer. " * 2)
    async with connected(nats_server.url) as nc:
        here = await send_prefill(nc, pf, prefill_job(unique(), prompt, pf, max_tokens=20, salt=SALT_A))
        f_here = await here.wait_final()
        split = await send_prefill(nc, pf, prefill_job(unique(), prompt, dc, max_tokens=20, salt=SALT_A))
        f_split = await split.wait_final()
        assert f_here.error is None and f_split.error is None
        assert here.ordered == split.ordered == reference(prompt, 20)
        assert {e.worker_id for e in here.events} == {pf}
        assert min(e.seq for e in here.events) == 0 and here.dropped == 0
        assert here.events[0].prompt_tokens == len(prompt)

        # The next turn extends prompt + answer: decoded here, both are in pf's pool already.
        turn2 = prompt + here.ordered + reference.tokenizer.encode(" And then?")
        nxt = await send_prefill(nc, pf, prefill_job(unique(), turn2, pf, max_tokens=8, salt=SALT_A))
        await nxt.wait_final()
        for c in (here, split, nxt):
            await c.close()
    assert nxt.ordered == reference(turn2, 8)
    answered = (len(prompt) + len(here.ordered) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert nxt.events[0].cached_tokens >= answered
    tiers = nxt.events[0].tier_tokens
    assert tiers["l1"] == nxt.events[0].cached_tokens and not any(n for t, n in tiers.items() if t != "l1")


async def test_migrated_away_mid_stream_ends_exactly_on_the_decode_worker(stack, nats_server, reference):
    """What the ingress does when a prefill worker decoding a request falls silent: fence attempt 0 there,
    hand prompt + delivered tokens to a decode worker as attempt 1."""
    pf, dc = _ids(stack)
    prompt = reference.tokenizer.encode("A long answer that starts on the prefill worker and ends elsewhere.")
    full = reference(prompt, 48)
    rid = unique()
    job = prefill_job(rid, prompt, pf, max_tokens=48, salt=SALT_A)
    job = job.model_copy(update={"sampling": SamplingSpec(max_tokens=48, ignore_eos=True)})
    async with connected(nats_server.url) as nc:
        c = await send_prefill(nc, pf, job)
        await until(lambda: len(c.ordered) >= 4, 60, "the first tokens decoded on the prefill worker", poll_s=0.01)
        await nc.publish(subjects.abort(pf), AbortRequest(request_id=rid, attempt=0, reason="migrated").to_bytes())
        delivered = list(c.ordered)
        migrated = DecodeJob(request_id=rid, attempt=1, tenant="t", tenant_salt=SALT_A, prompt_ids=prompt,
                             generated=delivered, sampling=job.sampling, prompt_tokens=len(prompt),
                             deadline=time.time() + 60)
        d = await send(nc, subjects.jobs_decode(dc), migrated)
        final = await d.wait_final()
        # pf took the abort before this later request, which decodes 64 steps there: an attempt 0 still
        # running would have ended (44 steps at most were left) and sent its final event by the later one's.
        await later_request(nc, pf, pf, max_tokens=64)
        await taken(nc, c)
        await c.close()
        await d.close()
    assert final.error is None and final.worker_id == dc and final.attempt == 1
    assert delivered + [d.tokens[s] for s in range(len(delivered), 48)] == full
    assert not any(e.finished for e in c.events if e.attempt == 0), "the fenced attempt ran on to its end"
    assert not _logged(stack, pf, rid, "decoded here")
