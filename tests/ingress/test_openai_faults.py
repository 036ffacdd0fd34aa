"""Supervision on a real stack with two prefill and two decode workers.

A prefill worker that stalls (SIGSTOP) after it was sent the job, or is
SIGKILLed before its handoff: the job is retried on the other one. A decode worker SIGKILLed mid-stream: the request
migrates (prompt + tokens so far) and the client's stream goes on with
exactly the reference tokens, none duplicated or missing. Affinity keys pick
the victim: the rendezvous home of a key is where its request goes.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvmesh.protocol import subjects
from kvmesh.stack.servers import S3Server
from waits import until_sync

from ingress.serving_stack import ServingStack, ingress_retries, key_homed_on, own_nats, stream_killing

KEY = "sk-faults"
PREFILLS, DECODES = ["prefill-0", "prefill-1"], ["decode-0", "decode-1"]
LONG = 400  # tokens: long enough that a kill lands mid-stream


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with own_nats(tmp_path_factory.mktemp("ingress-faults"), s3_server, tiny_model_dir, {KEY: "faults"},
                  bucket="kvmesh-ingress-faults", KVMESH_INGRESS__FIRST_TOKEN_TIMEOUT_S="10",
                  KVMESH_INGRESS__INTER_TOKEN_TIMEOUT_S="5") as s:
        for worker in PREFILLS:
            s.start("prefill", worker)
        for worker in DECODES:
            s.start("decode", worker)
        s.start_ready("ingress", "ingress-0")
        _wait_all_live(s)
        yield s


def _wait_all_live(s: ServingStack) -> None:
    """Both workers of each role seen by the ingress (readiness needs only one of each)."""
    until_sync(lambda: all(s.procs[w].proc.poll() is None for w in PREFILLS + DECODES) and _live_count(s) >= 4,
               60, "all four workers running and live in the workers bucket", poll_s=0.3)


def _live_count(s: ServingStack) -> int:
    import asyncio

    import nats as nats_py
    from kvmesh.service.watch import alive_workers

    async def count() -> int:
        nc = await nats_py.connect(s.nats.url)
        try:
            return sum(1 for w in await alive_workers(nc.jetstream()) if w in PREFILLS + DECODES)
        finally:
            await nc.close()

    return asyncio.run(count())


def _last_job_seq(s: ServingStack, worker: str) -> int:
    """The JOBS stream sequence of the latest job stored for prefill `worker` (0: none)."""
    import asyncio

    import nats as nats_py
    from nats.js.errors import NotFoundError

    async def last() -> int:
        nc = await nats_py.connect(s.nats.url)
        try:
            return (await nc.jetstream().get_last_msg("JOBS", subjects.jobs_prefill(worker))).seq
        except NotFoundError:
            return 0
        finally:
            await nc.close()

    return asyncio.run(last())


def client(stack: ServingStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def wait_routed_to(stack: ServingStack, key: str, route: str, timeout_s: float = 20.0) -> None:
    """Send small requests with affinity `key` until the ingress routes them as `route` says."""
    c = client(stack)

    def routed() -> bool:
        raw = c.completions.with_raw_response.create(model=stack.model_dir.name, prompt="ping", max_tokens=1,
                                                     extra_body={"prompt_cache_key": key})
        return route in raw.headers["kvmesh-route"]

    until_sync(routed, timeout_s, f"requests with key {key} routed as {route}", poll_s=0.3)


def long_prompt(stack: ServingStack) -> tuple[str, str]:
    """A prompt whose greedy continuation runs the full LONG tokens, and that continuation."""
    c = client(stack)
    for i in range(20):
        prompt = f"Write a very long story, number {i}, about the sea:"
        r = c.completions.create(model=stack.model_dir.name, prompt=prompt, max_tokens=LONG, temperature=0)
        if r.choices[0].finish_reason == "length":
            return prompt, r.choices[0].text
    pytest.fail("no prompt generates LONG tokens without eos")


def test_stalled_prefill_is_retried_elsewhere(stack: ServingStack) -> None:
    prompt = "A prefill that stalls, and the one that takes over"
    c = client(stack)
    ref = c.completions.create(model=stack.model_dir.name, prompt=prompt, max_tokens=20, temperature=0)
    key = key_homed_on(PREFILLS, "prefill-0")
    wait_routed_to(stack, key, "prefill=prefill-0")
    before = ingress_retries(stack)
    stack.signal("prefill-0", signal.SIGSTOP)
    try:
        raw = c.completions.with_raw_response.create(model=stack.model_dir.name, prompt=prompt, max_tokens=20,
                                                     temperature=0, extra_body={"prompt_cache_key": key})
    finally:
        stack.signal("prefill-0", signal.SIGCONT)
    got = raw.parse()
    assert got.choices[0].text == ref.choices[0].text
    assert "prefill=prefill-1" in raw.headers["kvmesh-route"] and "attempts=2" in raw.headers["kvmesh-route"]
    assert ingress_retries(stack) == before + 1


def test_prefill_killed_before_handoff_is_retried_elsewhere(stack: ServingStack) -> None:
    """SIGKILL while the job sits with prefill-0 (stopped first, so it surely has not handed off)."""
    import threading

    prompt = "A prefill that dies holding the job"
    c = client(stack)
    ref = c.completions.create(model=stack.model_dir.name, prompt=prompt, max_tokens=20, temperature=0)
    key = key_homed_on(PREFILLS, "prefill-0")
    wait_routed_to(stack, key, "prefill=prefill-0")  # back in the ingress's table after the previous test's SIGSTOP
    before = ingress_retries(stack)
    stack.signal("prefill-0", signal.SIGSTOP)
    stored_before = _last_job_seq(stack, "prefill-0")
    result: dict[str, object] = {}

    def call() -> None:
        result["raw"] = c.completions.with_raw_response.create(
            model=stack.model_dir.name, prompt=prompt, max_tokens=20, temperature=0,
            extra_body={"prompt_cache_key": key})

    caller = threading.Thread(target=call)
    caller.start()
    until_sync(lambda: _last_job_seq(stack, "prefill-0") > stored_before, 30, "the job stored for prefill-0",
               poll_s=0.1)
    stack.signal("prefill-0", signal.SIGKILL)
    caller.join(timeout=60)
    raw = result["raw"]
    assert raw.parse().choices[0].text == ref.choices[0].text  # type: ignore[attr-defined]
    assert "prefill=prefill-1" in raw.headers["kvmesh-route"]  # type: ignore[attr-defined]
    assert ingress_retries(stack) == before + 1


def test_decode_killed_mid_stream_migrates(stack: ServingStack) -> None:
    prompt, reference = long_prompt(stack)
    key = key_homed_on(DECODES, "decode-0")
    before = ingress_retries(stack)
    text, finish = stream_killing(stack, client(stack), "decode-0", "decode=decode-0", model=stack.model_dir.name,
                                  prompt=prompt, max_tokens=LONG, temperature=0, extra_body={"prompt_cache_key": key})
    assert text == reference
    assert finish == "length"
    assert ingress_retries(stack) == before + 1


def test_request_that_cannot_finish_ends_with_an_error_event(stack: ServingStack) -> None:
    """The last decode worker dies mid-stream: no one can continue, so the stream ends in an error, not [DONE]."""
    prompt, reference = long_prompt(stack)
    c = client(stack)
    parts: list[str] = []
    with pytest.raises(openai.APIError) as err:
        stream = c.completions.create(model=stack.model_dir.name, prompt=prompt, max_tokens=LONG, temperature=0,
                                      stream=True)
        for i, chunk in enumerate(stream):
            parts.append(chunk.choices[0].text)
            if i == 2:
                stack.signal("decode-1", signal.SIGKILL)
    assert "no live decode worker" in str(err.value.message)
    text = "".join(parts)
    assert reference.startswith(text) and len(text) < len(reference)
