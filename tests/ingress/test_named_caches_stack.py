"""Named caches end to end: create/get/list/delete, tenant scope, use from both dialects, a full restart.

The module's stack has its own NATS and S3 server (data dirs kept), so the
last test can stop everything and start it again: the cache's metadata
comes back from the JetStream KV bucket and its blocks from L3.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from kvmesh.config import EngineSettings

from ingress.serving_stack import ServingStack, own_nats_and_s3

KEYS = {"sk-nc-a": "nc-a", "sk-nc-b": "nc-b"}
BLOCK = EngineSettings().block_size
SYSTEM = "You are the release agent of the kvmesh repository. You read the changelog first. " * 4
SERVICES = (("prefill", "prefill-0"), ("decode", "decode-0"), ("ingress", "ingress-0"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServingStack]:
    with own_nats_and_s3(tmp_path_factory.mktemp("named-caches"), tiny_model_dir, KEYS) as s:
        start_services(s)
        yield s


def start_services(s: ServingStack) -> None:
    for service, worker in SERVICES[:-1]:
        s.start(service, worker)
    s.start_ready(*SERVICES[-1])


def api(s: ServingStack, method: str, path: str, key: str = "sk-nc-a", **kw) -> httpx.Response:
    return httpx.request(method, f"{s.base_url}{path}", headers={"x-api-key": key}, timeout=60, **kw)


def create(s: ServingStack, **body) -> dict:
    r = api(s, "POST", "/v1/caches", json={"model": s.model_dir.name, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_lifecycle_and_tenant_scope(stack: ServingStack) -> None:
    cache = create(stack, system="A short-lived cache for the lifecycle test.", ttl="2m", display_name="life")
    assert cache["id"].startswith("cache_") and cache["object"] == "cache" and cache["ttl_seconds"] == 120
    assert cache["usage"]["prompt_tokens"] > 0
    cid = cache["id"]
    assert api(stack, "GET", f"/v1/caches/{cid}").json()["display_name"] == "life"
    assert cid in [c["id"] for c in api(stack, "GET", "/v1/caches").json()["data"]]
    # another tenant neither sees, lists, uses nor deletes it
    assert api(stack, "GET", f"/v1/caches/{cid}", key="sk-nc-b").status_code == 404
    assert cid not in [c["id"] for c in api(stack, "GET", "/v1/caches", key="sk-nc-b").json()["data"]]
    assert api(stack, "DELETE", f"/v1/caches/{cid}", key="sk-nc-b").status_code == 404
    b = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-nc-b", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        b.chat.completions.create(model=stack.model_dir.name, max_tokens=2, extra_body={"cache_id": cid},
                                  messages=[{"role": "user", "content": "hi"}])
    deleted = api(stack, "DELETE", f"/v1/caches/{cid}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert api(stack, "GET", f"/v1/caches/{cid}").status_code == 404
    assert api(stack, "DELETE", f"/v1/caches/{cid}").status_code == 404


def test_bad_requests(stack: ServingStack) -> None:
    model = stack.model_dir.name
    for body in ({"model": model, "system": "x", "ttl": "10s"}, {"model": model, "system": "x", "ttl": "31d"},
                 {"model": model, "system": "x", "ttl": "soon"}, {"model": model}):
        r = api(stack, "POST", "/v1/caches", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body
    assert api(stack, "POST", "/v1/caches", json={"model": "nope", "system": "x"}).status_code == 404
    assert httpx.get(f"{stack.base_url}/v1/caches").status_code == 401


def _turn(stack: ServingStack, cid: str, text: str) -> tuple[int, int, str]:
    """(cached, prompt tokens, answer) of one OpenAI turn on the cache and one Anthropic turn; both must agree."""
    o = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-nc-a", max_retries=0, timeout=60)
    r = o.chat.completions.create(model=stack.model_dir.name, max_tokens=6, temperature=0,
                                  messages=[{"role": "user", "content": text}], extra_body={"cache_id": cid})
    return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens, r.choices[0].message.content


def test_use_from_both_dialects_and_survive_restart(stack: ServingStack) -> None:
    cache = create(stack, system=SYSTEM, tools=[{"name": "git_log", "description": "Show the log.",
                                                 "input_schema": {"type": "object"}}],
                   messages=[{"role": "user", "content": "Here is the changelog: fixed the L3 reader."},
                             {"role": "assistant", "content": "Noted."}], ttl="7d")
    cid, floor = cache["id"], cache["usage"]["prompt_tokens"] // BLOCK * BLOCK
    assert cache["ttl_seconds"] == 7 * 86400 and floor > 0

    cached, prompt, answer = _turn(stack, cid, "What changed?")
    assert cached >= floor and prompt > cache["usage"]["prompt_tokens"]
    a = anthropic.Anthropic(base_url=stack.base_url, api_key="sk-nc-a", max_retries=0, timeout=60)
    m = a.messages.create(model=stack.model_dir.name, max_tokens=6, messages=[{"role": "user", "content": "What changed?"}],
                          extra_body={"cache_id": cid, "temperature": 0})
    assert m.usage.cache_read_input_tokens >= floor and m.content[0].text == answer

    # stop every process (NATS and S3 keep their data dirs), start again: nothing in L1/L2 survives
    stack.stop()
    stack.nats.stop()
    stack.s3.stop()
    stack.s3.start()
    stack.nats.start()
    start_services(stack)
    assert api(stack, "GET", f"/v1/caches/{cid}").json()["id"] == cid
    raw = a.messages.with_raw_response.create(model=stack.model_dir.name, max_tokens=6,
                                              messages=[{"role": "user", "content": "What changed?"}],
                                              extra_body={"cache_id": cid, "temperature": 0})
    m2 = raw.parse()
    assert m2.usage.cache_read_input_tokens >= floor and m2.content[0].text == answer
    request_id = raw.headers["request-id"]
    lines = [json.loads(x) for x in stack.log("prefill-0").splitlines() if request_id in x and '"prefilled"' in x]
    assert lines and lines[-1]["sources"].get("L3", 0) * BLOCK >= floor, lines
