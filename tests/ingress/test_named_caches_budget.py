"""Pin budgets and the named-cache TTL end to end: real NATS, S3, workers, eviction service, ingress, SDKs.

The stack's default L3 TTL (tiers.l3_ttl_s, one hour) differs from the named
cache's (two days), and each tenant may pin `CAP_BLOCKS` blocks
(pins.l3_tenant_bytes at `pins.block_bytes` a block). A named cache's L3
objects carry its TTL; a second cache or a cache_control breakpoint past the
tenant's cap is a 429 in the route's dialect, naming the cap; another
tenant is unaffected; deleting a cache frees its budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from kvmesh.config import EngineSettings
from kvmesh.eviction.l3_gc import scan
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.s3_client import fast_fail_client

from ingress.serving_stack import ServingStack, own_nats_and_s3

KEYS = {"sk-pb-a": "pb-a", "sk-pb-b": "pb-b"}
BLOCK = EngineSettings().block_size
BLOCK_BYTES = 1000
CAP_BLOCKS = 7
DEFAULT_TTL, NAMED_TTL = 3600, 2 * 86400
SERVICES = (("prefill", "prefill-0"), ("decode", "decode-0"), ("eviction", "eviction-0"), ("ingress", "ingress-0"))
FIRST = "You are the build agent of the kvmesh repository. You run the tests before every commit. " * 2
SECOND = "You are the docs agent of the kvmesh repository. You keep every page honest and short. " * 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServingStack]:
    with own_nats_and_s3(tmp_path_factory.mktemp("pin-budgets"), tiny_model_dir, KEYS,
                         KVMESH_TIERS__L3_TTL_S=str(DEFAULT_TTL), KVMESH_PINS__BLOCK_BYTES=str(BLOCK_BYTES),
                         KVMESH_PINS__L3_TENANT_BYTES=str(CAP_BLOCKS * BLOCK_BYTES),
                         KVMESH_EVICTION__GC_INTERVAL_S="3600") as s:
        for service, worker in SERVICES:
            s.start_ready(service, worker)
        yield s


def _caches(stack: ServingStack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _create(client: openai.OpenAI, model: str, system: str) -> dict:
    return client.post("/caches", body={"model": model, "system": system, "ttl": "2d"}, cast_to=httpx.Response).json()


def _l3(stack: ServingStack) -> L3Store:
    client = fast_fail_client(stack.s3.endpoint, stack.s3.access_key, stack.s3.secret_key)
    return L3Store(client, stack.bucket, "")


def test_named_ttl_wins_caps_refuse_with_429_and_delete_frees(stack: ServingStack) -> None:
    model = stack.model_dir.name
    a, b = _caches(stack, "sk-pb-a"), _caches(stack, "sk-pb-b")
    first = _create(a, model, FIRST)
    blocks = first["usage"]["prompt_tokens"] // BLOCK
    second_blocks = len(SECOND) * blocks // len(FIRST)
    assert blocks <= CAP_BLOCKS < blocks + second_blocks - 1, (blocks, "the prompts do not fit the test's cap")

    # Every L3 object of the cache (the upload queue wrote them too, with the one-hour default) has its TTL.
    objects = scan(_l3(stack))
    assert objects and {o.ttl_s for o in objects} == {NAMED_TTL}, [(o.key, o.ttl_s) for o in objects]

    with pytest.raises(openai.RateLimitError) as over:
        _create(a, model, SECOND)
    err = over.value.body
    assert over.value.status_code == 429 and err["code"] == "pin_budget_exceeded", err
    assert "tenant's pinned-bytes cap" in err["message"] and str(CAP_BLOCKS * BLOCK_BYTES) in err["message"]

    # A cache_control breakpoint past the cap: Anthropic's 429, rate_limit_error.
    msgs = anthropic.Anthropic(base_url=stack.base_url, api_key="sk-pb-a", max_retries=0, timeout=60)
    system = [{"type": "text", "text": SECOND, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    with pytest.raises(anthropic.RateLimitError) as refused:
        msgs.messages.create(model=model, max_tokens=2, system=system, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 429
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert "pin budget exceeded" in refused.value.body["error"]["message"]

    # Another tenant has its own budget; deleting the first cache frees tenant a's.
    assert _create(b, model, SECOND)["id"].startswith("cache_")
    assert a.delete(f"/caches/{first['id']}", cast_to=httpx.Response).json()["deleted"] is True
    assert _create(a, model, SECOND)["id"].startswith("cache_")
    # The breakpoint under the cap now (the same prefix, already pinned: free) is served.
    ok = msgs.messages.create(model=model, max_tokens=2, system=system, messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.cache_read_input_tokens > 0
