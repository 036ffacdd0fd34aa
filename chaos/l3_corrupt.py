"""The l3-corrupt probe: stored L3 chunks are damaged, and a worker that must read them still answers right.

A long shared prefix P is computed together with the references of a few
continuations; once its chunks are in L3, every object in the bucket gets
its last byte flipped (the tail of a block payload: a checksum miss, not a
header error). Every worker is then killed (the decode workers hold P too,
and any worker's L1/L2 is a peer source), prefill-0 and decode-0 restart
empty, so a continuation can only find P in the damaged L3 chunks (the
eviction service is paused meanwhile: its scrub would remove them first).
It must count checksum misses on /metrics and answer exactly the reference;
the scenario's cleanup restarts the other two (`restart_rest`), and the
scrub removes the rest.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import openai
from kvmesh.chaos.stack import API_KEY, BUCKET, EVICTION, WORKERS, ChaosStack

READERS = ("prefill-0", "decode-0")  # restarted empty: they may find P only in L3
REST = tuple(w for w in WORKERS if w not in READERS)

_MISS = re.compile(r'^kvmesh_tier_miss_total\{reason="checksum",tier="L3"\} (\S+)$', re.M)


def corrupt_objects(stack: ChaosStack, truncate: bool = False) -> int:
    """Flip the last byte of (or cut the last 64 bytes from) every object in the bucket; how many were hit."""
    import io

    client = stack.s3.client()
    hit = 0
    for obj in client.list_objects(BUCKET, recursive=True):
        resp = client.get_object(BUCKET, obj.object_name)
        try:
            body = bytearray(resp.read())
        finally:
            resp.close()
            resp.release_conn()
        if len(body) < 65:
            continue
        body = body[:-64] if truncate else body[:-1] + bytes([body[-1] ^ 0xFF])
        client.put_object(BUCKET, obj.object_name, io.BytesIO(bytes(body)), len(body))
        hit += 1
    return hit


def checksum_misses(stack: ChaosStack, worker: str) -> float:
    match = _MISS.search(httpx.get(f"http://127.0.0.1:{stack.ports[worker]}/metrics", timeout=5).text)
    return float(match.group(1)) if match else 0.0


def _complete(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    return raw.parse().choices[0].text, raw.headers.get("kvmesh-route", "")


def probe(stack: ChaosStack, refs_unused: dict[str, str], timeout_s: float = 60.0) -> dict[str, bool]:
    """Warm P, corrupt every L3 object, read P back through a prefill worker that has it only in L3."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    model = stack.model_dir.name
    prefix = f"Lighthouse log {time.time_ns()}: " + "the tide rose over the rocks and fell back again, " * 12
    endings = [f"Entry {i} reads:" for i in range(3)]
    refs = {ending: _complete(client, model, prefix + ending)[0] for ending in endings}
    objects = stack.s3.client()
    deadline = time.monotonic() + timeout_s
    while not any(True for _ in objects.list_objects(BUCKET, recursive=True)) and time.monotonic() < deadline:
        time.sleep(0.1)
    stack.signal(EVICTION, signal.SIGSTOP)  # its scrub would delete the damage before the reader meets it
    try:
        corrupted = corrupt_objects(stack)
        # Nothing but L3 may hold P now: two workers restart empty, the rest stay down (the cleanup restarts them).
        for worker in WORKERS:
            stack.signal(worker, signal.SIGKILL)
        for worker in READERS:
            stack.restart(worker, timeout_s, wait_all=False)
        for worker in REST:
            stack.wait_down(worker, timeout_s)
        text, route = _complete(client, model, prefix + endings[-1])
    finally:
        stack.signal(EVICTION, signal.SIGCONT)
    return {"l3_objects_corrupted": corrupted > 0, "l3_read_by_fresh_worker": "prefill=prefill-0" in route,
            "l3_output_identical": text == refs[endings[-1]],
            "l3_checksum_miss_counted": checksum_misses(stack, "prefill-0") > 0}


def restart_rest(stack: ChaosStack) -> None:
    """The cleanup: the workers the probe left down come back, and the stack waits until all are live."""
    for worker in REST:
        stack.restart(worker, wait_all=False)
    stack.wait_live(120.0)
