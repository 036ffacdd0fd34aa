"""The l3-corrupt probe: stored L3 chunks are damaged, and a worker that must read them still answers right.

A long shared prefix P is computed on prefill-0 (affinity key homed there)
together with the references of a few continuations; once its chunks are in
L3, every object in the bucket gets its last byte flipped (the tail of a
block payload: a checksum miss, not a header error). A continuation is then
sent with a key homed on prefill-1, which holds P in neither L1 nor L2, so it
reads the damaged chunks from L3. It must count checksum misses on /metrics
and answer exactly the reference.
"""

from __future__ import annotations

import re
import time

import httpx
import openai

from chaos.stack import API_KEY, BUCKET, PREFILLS, ChaosStack
from shared.ingress.router import home

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


def checksum_misses(stack: ChaosStack) -> float:
    total = 0.0
    for service_id, port in stack.ports.items():
        if service_id.startswith(("prefill", "decode")):
            match = _MISS.search(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
            total += float(match.group(1)) if match else 0.0
    return total


def _key_for(target: str) -> str:
    return next(k for k in (f"chaos-{i}" for i in range(1000)) if home(k, PREFILLS) == target)


def _complete(client: openai.OpenAI, model: str, prompt: str, key: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                      extra_body={"prompt_cache_key": key})
    return raw.parse().choices[0].text, raw.headers.get("kvmesh-route", "")


def probe(stack: ChaosStack, refs_unused: dict[str, str], timeout_s: float = 60.0) -> dict[str, bool]:
    """Warm P on prefill-0, corrupt every L3 object, read P back through prefill-1; the invariants it saw."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    model = stack.model_dir.name
    prefix = f"Lighthouse log {time.time_ns()}: " + "the tide rose over the rocks and fell back again, " * 12
    endings = [f"Entry {i} reads:" for i in range(6)]
    home_key, away_key = _key_for("prefill-0"), _key_for("prefill-1")
    refs: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(refs) < len(endings) and time.monotonic() < deadline:  # all on prefill-0, never on prefill-1
        ending = endings[len(refs)]
        text, route = _complete(client, model, prefix + ending, home_key)
        if "prefill=prefill-1" in route:
            return {"l3_probe_routed": False}  # prefill-1 saw P: the probe cannot force an L3 read
        refs[ending] = text
    objects = stack.s3.client()
    while not any(True for _ in objects.list_objects(BUCKET, recursive=True)) and time.monotonic() < deadline:
        time.sleep(0.1)
    before = checksum_misses(stack)
    corrupted = corrupt_objects(stack)
    for ending in endings[1:]:  # the first warmed P on prefill-0; any later one may be tried on prefill-1
        text, route = _complete(client, model, prefix + ending, away_key)
        if "prefill=prefill-1" in route:
            return {"l3_objects_corrupted": corrupted > 0, "l3_output_identical": text == refs[ending],
                    "l3_checksum_miss_counted": checksum_misses(stack) > before}
    return {"l3_probe_routed": False}
