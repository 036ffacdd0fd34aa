"""Cache-aware routing end to end: nats + S3 + cache-index + 2 prefill + 1 decode + ingress subprocesses.

`ingress-0` routes by cost (the default); `ingress-rr` is a second ingress
on the same bus with the real setting `ingress.routing=round_robin`, used to
put a prefix on a chosen worker and to force a session to alternate
between the two prefill workers.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import nats
import openai
import pytest
from ingress.serving_stack import ServingStack, own_nats
from kvmesh.cache_index.client import lookup_prefix
from kvmesh.config import EngineSettings
from kvmesh.ingress.admission.auth import KeyRing
from kvmesh.net import free_port
from kvmesh.protocol.block_hash import HashKeys, hash_blocks
from kvmesh.service.watch import watch_workers
from kvmesh.stack.servers import S3Server
from waits import until

KEYS = {"sk-route": "route"}
BLOCK = EngineSettings().block_size
PREFILLS = ("prefill-0", "prefill-1")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with own_nats(tmp_path_factory.mktemp("routing-stack"), s3_server, tiny_model_dir, KEYS) as s:
        ports = {w: s.start(svc, w) for svc, w in (("cache_index", "index-0"), ("prefill", "prefill-0"),
                                                  ("prefill", "prefill-1"), ("decode", "decode-0"))}
        for worker, port in ports.items():
            s.wait_ready(port, worker)
        s.start_ready("ingress", "ingress-0")
        rr_port = free_port()
        base = dict(s.extra_env)
        s.extra_env.update(KVMESH_INGRESS__ROUTING="round_robin", KVMESH_INGRESS__PORT=str(rr_port))
        try:
            s.start_ready("ingress", "ingress-rr")
        finally:
            s.extra_env = base
        s.rr_url = f"http://127.0.0.1:{rr_port}"  # type: ignore[attr-defined]
        yield s


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-route", max_retries=0, timeout=60)


def complete(stack: ServingStack, base_url: str, prompt: str, max_tokens: int = 8) -> tuple[str, int, str]:
    """(prefill worker, cached tokens, text) of one greedy completion."""
    raw = client(base_url).completions.with_raw_response.create(model=stack.model_dir.name, prompt=prompt,
                                                                max_tokens=max_tokens, temperature=0)
    got = raw.parse()
    prefill = re.search(r"prefill=([^;]+)", raw.headers["kvmesh-route"]).group(1)
    return prefill, got.usage.prompt_tokens_details.cached_tokens, got.choices[0].text


@functools.cache
def _loaded(model_dir: Path):
    from kvmesh.engine.loader import load_model

    return load_model(model_dir)


def wait_indexed(stack: ServingStack, worker: str, prompt: str) -> None:
    """Until the cache index answers that `worker` holds every block of `prompt` a later request can use.

    The prompt is hashed as the ingress hashes it (the model's fingerprint, the tenant's salt), and
    the index is asked as the ingress asks it.
    """
    loaded = _loaded(stack.model_dir)
    ids = loaded.tokenizer.encode(prompt)
    salt = KeyRing(KEYS, bytes.fromhex(stack.secret)).salt(KEYS["sk-route"])
    hashes = list(hash_blocks(ids, BLOCK, HashKeys(loaded.fingerprint, bytes.fromhex(salt))))
    usable = (len(ids) - 1) // BLOCK  # the last prompt token is always computed

    async def wait() -> None:
        nc = await nats.connect(stack.nats.url)
        try:
            async def held() -> bool:
                reply = await lookup_prefix(nc, hashes, timeout_s=2.0)
                return reply is not None and any(m.worker == worker and m.blocks >= usable for m in reply.workers)
            await until(held, 30, f"the index showing {usable} blocks of the prompt on {worker}")
        finally:
            await nc.close()

    asyncio.run(wait())


def wait_idle(stack: ServingStack, workers: tuple[str, ...] = PREFILLS) -> None:
    """Until each worker wrote two heartbeats in a row with nothing in flight.

    The ingress follows the same bucket in order: by the second, it has taken the first, so it
    prices the worker as idle (the second says it still is).
    """

    async def wait() -> None:
        nc = await nats.connect(stack.nats.url)
        changes = watch_workers(nc.jetstream(), updates=True)
        idle_beats = dict.fromkeys(workers, 0)
        try:
            async def two_idle() -> None:
                async for change in changes:
                    if change.worker_id in idle_beats and change.heartbeat is not None:
                        idle = change.heartbeat.load == 0
                        idle_beats[change.worker_id] = idle_beats[change.worker_id] + 1 if idle else 0
                        if min(idle_beats.values()) >= 2:
                            return
            async with asyncio.timeout(30):
                await two_idle()
        except TimeoutError:
            raise AssertionError(f"timed out waiting for two idle heartbeats in a row of {workers}: "
                                 f"{idle_beats}") from None
        finally:
            await changes.aclose()
            await nc.close()

    asyncio.run(wait())


def seed_on(stack: ServingStack, worker: str, prompt: str) -> None:
    """Prefill `prompt` on `worker` only, through the round-robin ingress, then let the index learn it.

    A block-less filler advances the rotation until the next turn is `worker`'s (two prefill workers).
    """
    rr = stack.rr_url  # type: ignore[attr-defined]
    while complete(stack, rr, "ping", max_tokens=1)[0] == worker:
        pass
    assert complete(stack, rr, prompt, max_tokens=1)[0] == worker
    wait_indexed(stack, worker, prompt)  # the index applied its KV events (batched 20 ms)
    wait_idle(stack)  # and the ingress has the workers' heartbeats saying they are idle again


def metric(stack: ServingStack, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", stack.metrics(), re.M)
    return float(match.group(1)) if match else 0.0


def test_returning_session_goes_to_the_prefix_holder_without_affinity(stack: ServingStack) -> None:
    for holder in ("prefill-1", "prefill-0"):  # each worker once: not just the load-order tie-break
        context = f"Agent transcript for worker {holder}. " + "The tool returned file listing number 7. " * 12
        seed_on(stack, holder, context)
        for turn in range(2):
            prefill, cached, _ = complete(stack, stack.base_url, context + f" Turn {turn}: what next?")
            assert prefill == holder, (turn, prefill)
            assert cached >= (len(context) // 8 // BLOCK) * BLOCK > 0  # most of the context's blocks hit
            wait_idle(stack)  # the finished request no longer counts as the holder's load


def test_an_overloaded_holder_sheds_the_prefix_to_the_other_worker(stack: ServingStack) -> None:
    from concurrent.futures import ThreadPoolExecutor

    context = "Shared hot system prompt of a popular agent. " + "Rules: be brief, cite files, run tests. " * 12
    seed_on(stack, "prefill-1", context)
    assert complete(stack, stack.base_url, context + " Q?")[0] == "prefill-1"  # alone: the holder
    wait_idle(stack)
    with ThreadPoolExecutor(6) as pool:  # six at once, each in flight on its prefill worker until it finishes
        routes = list(pool.map(lambda i: complete(stack, stack.base_url, context + f" Q{i}?", max_tokens=48),
                               range(6)))
    chosen = [r[0] for r in routes]
    assert set(chosen) == set(PREFILLS), chosen  # the holder's load sent some elsewhere
    assert all(cached > 0 for _, cached, _ in routes)  # the others got the prefix from the peer or L3


def test_alternating_workers_reuse_the_prefix_from_peer_or_l3(stack: ServingStack) -> None:
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling import SamplingParams

    loaded = load_model(stack.model_dir)
    engine = Engine(loaded, EngineSettings(num_blocks=256))
    session = "System: you are a coding agent. " + "Observation: the build log says tests passed. " * 10
    workers, lengths = [], []
    for turn in range(3):
        session += f" User turn {turn}: continue. Tool output: " + f"file_{turn}.py changed, lint clean. " * 6
        ids = loaded.tokenizer.encode(session)
        prefill, cached, text = complete(stack, stack.rr_url, session)  # type: ignore[attr-defined]
        workers.append(prefill)
        lengths.append(len(ids))
        ref = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert text == ref.text, turn
        if turn:
            # the previous turn ran on the other worker only: its blocks beyond what this worker computed
            # itself (turn - 2) came from the peer or L3, not from a recompute
            own = lengths[turn - 2] if turn >= 2 else 0
            assert cached >= (lengths[turn - 1] // BLOCK - 1) * BLOCK > own, (turn, prefill, cached, lengths)
        # The next turn, on the other worker, reaches these blocks where the index says they are.
        wait_indexed(stack, prefill, session)
        session += text
    assert workers[0] != workers[1] != workers[2]


def test_index_down_routes_by_load_and_counts(stack: ServingStack) -> None:
    before = metric(stack, "kvmesh_ingress_routing_degraded_total")
    stack.procs.pop("index-0").stop(grace_s=3.0)
    prompt = "With the index gone the ingress still answers. " * 4
    seen = {complete(stack, stack.base_url, prompt + str(i), max_tokens=2)[0] for i in range(3)}
    assert seen <= set(PREFILLS)
    assert metric(stack, "kvmesh_ingress_routing_degraded_total") >= before + 3
