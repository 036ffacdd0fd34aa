"""A handed-off prompt that takes several engine steps streams to the decode worker while it is prefilled.

Real processes: prefill `pf-` and decode `dc-` on the session's NATS and S3, with a step budget of two
blocks, so a prompt of a dozen blocks is prefilled in several steps. After each step the prefill worker
stores what the step cached in its L2 and sends the decode worker a pull (shared/serving/prefill_stream.py);
the decode worker brings those blocks into its pool before the DecodeJob comes. The tokens are the
reference's either way, and a handoff whose blocks left the prefill worker's memory before decode read
them is recomputed, not an error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from bus.helpers import connected
from kvmesh.protocol import subjects
from kvmesh.protocol.block_hash import HashKeys, hash_blocks
from kvmesh.protocol.blocks import BlockHandle, Tier
from kvmesh.protocol.serving import DecodeJob, SamplingSpec
from waits import until

from .harness import BLOCK_SIZE, SALT_A, WorkerProcs, prefill_job, send, send_prefill, unique, worker_stack

pytestmark = pytest.mark.timeout(240)

BUCKET = "kvmesh-handoff-stream"
STEP_TOKENS = 2 * BLOCK_SIZE


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory) -> Iterator[WorkerProcs]:
    with worker_stack(nats_server, s3_server, BUCKET, tiny_model_dir, tmp_path_factory.mktemp("handoff-stream"),
                      (("prefill", "pf-"), ("decode", "dc-")),
                      KVMESH_ENGINE__MAX_NUM_BATCHED_TOKENS=str(STEP_TOKENS)) as procs:
        yield procs


def _logged(stack: WorkerProcs, worker: str, needle: str, event: str) -> list[dict]:
    return [json.loads(line) for line in stack.procs[worker].proc.log_path.read_text().splitlines()
            if needle in line and f'"{event}"' in line]


async def test_a_long_prompt_reaches_decode_while_it_is_prefilled(stack, nats_server, reference):
    pf, dc = list(stack.procs)[:2]
    prompt = reference.tokenizer.encode("A long prompt leaves for the decode worker step by step. " * 10)
    blocks = len(prompt) // BLOCK_SIZE
    assert blocks * BLOCK_SIZE > 3 * STEP_TOKENS  # several steps before the one that makes the first token
    rid = unique()
    async with connected(nats_server.url) as nc:
        c = await send_prefill(nc, pf, prefill_job(rid, prompt, dc, max_tokens=12, salt=SALT_A))
        final = await c.wait_final()
        await c.close()
    assert final.error is None
    assert c.ordered == reference(prompt, 12)
    assert {e.worker_id for e in c.events if e.seq > 0} == {dc}

    pulls = await until(lambda: _logged(stack, dc, f"{rid}:0:pull:", "pulled"), 20, f"{dc} applying {rid}'s pulls")
    assert all(p["owner"] == pf for p in pulls)
    # Each pull names the whole chain stored so far: a longer one every step, never the final step's blocks.
    sizes = [p["blocks"] for p in pulls]
    assert sizes == sorted(sizes) and 0 < sizes[-1] < blocks
    assert sum(p["fetched"] for p in pulls) > 0
    resolved = await until(lambda: _logged(stack, dc, rid, "decode blocks resolved"), 20, f"{dc} resolving {rid}")
    assert sum(resolved[0]["sources"].values()) == blocks


async def test_blocks_gone_from_the_prefill_worker_are_recomputed(stack, nats_server, reference):
    """The handles name the prefill worker, which no longer holds the blocks (its lease on them lapsed)."""
    pf, dc = list(stack.procs)[:2]
    salt = "e5" * 32  # never prefilled: neither the worker's L2 nor L3 has these blocks
    prompt = reference.tokenizer.encode("Blocks that left the prefill worker's memory before decode read them. " * 2)
    hashes = hash_blocks(prompt, BLOCK_SIZE, HashKeys(reference.fingerprint, bytes.fromhex(salt)))
    handles = [BlockHandle(block_hash=h.hex(), tier=Tier.L2, worker_id=pf, size=1, checksum="00") for h in hashes]
    expected = reference(prompt, 10)
    rid = unique()
    job = DecodeJob(request_id=rid, tenant="t", tenant_salt=salt, prompt_ids=prompt, generated=expected[:1],
                    sampling=SamplingSpec(max_tokens=10), handles=handles, prompt_tokens=len(prompt),
                    deadline=time.time() + 60)
    async with connected(nats_server.url) as nc:
        d = await send(nc, subjects.handoff(dc), job)
        final = await d.wait_final()
        await d.close()
    assert final.error is None and final.finish_reason == "length"
    assert [d.tokens[i] for i in range(1, 10)] == expected[1:]
    resolved = await until(lambda: _logged(stack, dc, rid, "decode blocks resolved"), 20, f"{dc} resolving {rid}")
    assert not resolved[0]["sources"]  # nothing fetched: every block was recomputed
