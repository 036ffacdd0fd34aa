"""A constrained request through real prefill and decode workers: the grammar crosses the handoff and a migration.

Prefill samples the first token under the grammar, decode replays it and
samples the rest; a migrated DecodeJob replays everything delivered so far.
Both must give exactly the in-process engine's constrained output.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import jsonschema
import pytest
from bus.helpers import connected
from kvmesh.protocol import subjects
from kvmesh.protocol.serving import Constraint, DecodeJob, SamplingSpec, ToolSchema

from .harness import (
    SALT_A,
    WorkerProcs,
    prefill_job,
    send,
    send_prefill,
    unique,
    worker_stack,
)

pytestmark = pytest.mark.timeout(240)

BUCKET = "kvmesh-serving-constrained"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city", "days"]}
CONSTRAINT = Constraint(kind="tool_calls", tool_format="hermes",
                        tools=[ToolSchema(name="get_weather", parameters=WEATHER), ToolSchema(name="ping")])
MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory) -> Iterator[WorkerProcs]:
    with worker_stack(nats_server, s3_server, BUCKET, tiny_model_dir,
                      tmp_path_factory.mktemp("serving-constrained")) as procs:
        yield procs



def _calls(text: str) -> list[dict]:
    chunks = text.split("\n")  # hermes: "<tool_call>", the JSON, "</tool_call>", per call, "\n"-joined
    assert len(chunks) % 3 == 0, text
    calls = []
    for i in range(0, len(chunks), 3):
        assert chunks[i] == "<tool_call>" and chunks[i + 2] == "</tool_call>", text
        calls.append(json.loads(chunks[i + 1]))
    return calls


async def test_constrained_call_through_prefill_and_decode(stack, nats_server, reference):
    pf, dc = list(stack.procs)[:2]
    prompt = reference.tokenizer.encode("What will the weather be in Lisbon for the next three days?")
    expected = reference(prompt, MAX_TOKENS, constraint=CONSTRAINT.model_dump_json())
    job = prefill_job(unique(), prompt, dc, max_tokens=MAX_TOKENS)
    job = job.model_copy(update={"sampling": SamplingSpec(max_tokens=MAX_TOKENS, constraint=CONSTRAINT)})
    async with connected(nats_server.url) as nc:
        coll = await send_prefill(nc, pf, job)
        final = await coll.wait_final()
    assert final.error is None and final.finish_reason == "stop"
    assert coll.ordered == expected
    calls = _calls(reference.tokenizer.decode(coll.ordered))
    for call in calls:
        assert call["name"] in ("get_weather", "ping")
        if call["name"] == "get_weather":
            jsonschema.validate(call["arguments"], WEATHER)


async def test_migrated_constrained_request_continues_the_grammar(stack, nats_server, reference):
    dc = list(stack.procs)[1]
    prompt = reference.tokenizer.encode("Ping the server, then check the weather in Oslo.")
    expected = reference(prompt, MAX_TOKENS, constraint=CONSTRAINT.model_dump_json())
    cut = len(expected) // 2
    rid = unique()
    job = DecodeJob(request_id=rid, attempt=1, tenant="t", tenant_salt=SALT_A, prompt_ids=prompt, generated=expected[:cut],
                    sampling=SamplingSpec(max_tokens=MAX_TOKENS, constraint=CONSTRAINT), handles=[],
                    prompt_tokens=len(prompt), deadline=time.time() + 120)
    async with connected(nats_server.url) as nc:
        coll = await send(nc, subjects.jobs_decode(dc), job)
        final = await asyncio.wait_for(coll.wait_final(), 120)
    assert final.finish_reason == "stop"
    assert [coll.tokens[s] for s in range(cut, len(expected))] == expected[cut:]
    assert max(coll.tokens) == len(expected) - 1
