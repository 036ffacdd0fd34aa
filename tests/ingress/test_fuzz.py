"""The ingress under hostile input, on a real stack (nats + S3 + prefill + decode + ingress, tiny model).

/openapi.json is served to key holders only and describes every route with
its request body; bodies past `ingress.max_body_bytes` get 413 whether
declared or streamed (chunked); deeply nested JSON, huge strings, invalid
UTF-8 and lone surrogates get 400 in the route's dialect. Then a bounded,
derandomized schemathesis pass (bench/fuzz_ingress.py) over every operation
of both dialects with valid auth: no 5xx, every error in the dialect's format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvmesh.bench.fuzz_ingress import FuzzConfig, error_problem, fuzz
from kvmesh.ingress.core.errors import Dialect, dialect_of
from kvmesh.stack.servers import S3Server

from ingress.serving_stack import ServingStack, one_of_each

KEY = "sk-fuzz"
LIMIT = 64 * 1024
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/caches", "/v1/messages",
          "/v1/messages/count_tokens")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("fuzz-stack"), s3_server, tiny_model_dir, {KEY: "fuzz"},
                     KVMESH_INGRESS__MAX_BODY_BYTES=str(LIMIT), KVMESH_INGRESS__RATE_LIMIT_PER_S="100000",
                     KVMESH_INGRESS__RATE_LIMIT_BURST="100000", KVMESH_LOG_LEVEL="warning") as s:
        yield s


def post(stack: ServingStack, path: str, content: bytes | Iterator[bytes]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", content=content, timeout=60,
                      headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})


def assert_dialect_error(path: str, r: httpx.Response, status: int) -> None:
    assert r.status_code == status, (path, r.status_code, r.text[:300])
    assert error_problem(path, r.status_code, r.content) is None, (path, r.text[:300])
    if dialect_of(path) is Dialect.ANTHROPIC:
        assert r.json()["error"]["type"] == ("request_too_large" if status == 413 else "invalid_request_error")


def test_openapi_document_behind_auth(stack: ServingStack) -> None:
    anonymous = httpx.get(f"{stack.base_url}/openapi.json", timeout=30)
    assert_dialect_error("/openapi.json", anonymous, 401)
    doc = httpx.get(f"{stack.base_url}/openapi.json", headers={"x-api-key": KEY}, timeout=30).json()
    assert doc["openapi"].startswith("3.") and {"bearer", "apiKey"} <= set(doc["components"]["securitySchemes"])
    paths = doc["paths"]
    assert {"/v1/models", "/v1/caches/{cache_id}", "/v1/responses/{response_id}",
            "/v1/sessions/{session_id}/end", *ROUTES} <= set(paths)
    schemas = doc["components"]["schemas"]
    for path in ROUTES:
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = schemas[ref.rsplit("/", 1)[1]]
        assert "model" in body["properties"] and "model" in body["required"]
    assert {"messages", "max_tokens"} <= set(schemas["MessagesRequest"]["required"])
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert "error" in paths["/v1/messages"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"][
        "$ref"].lower()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_oversized_bodies_get_413(stack: ServingStack, path: str) -> None:
    big = json.dumps({"model": "m", "pad": "x" * LIMIT}).encode()
    assert_dialect_error(path, post(stack, path, big), 413)  # declared by content-length
    chunks = iter([big[i:i + 8192] for i in range(0, len(big), 8192)])
    assert_dialect_error(path, post(stack, path, chunks), 413)  # chunked: counted as it streams


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_hostile_bodies_get_400(stack: ServingStack, path: str) -> None:
    model = stack.model_dir.name
    user = {"role": "user", "content": "hi"}
    hostile = [
        b'{"model": "m", "messages": ' + b"[" * 100 + b"]" * 100 + b"}",  # nested past the ingress's limit
        b'{"model": "m", "x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",  # past the JSON parser's own stack
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe bad utf-8"}]}',
        json.dumps({"model": model, "max_tokens": 2, "input": "\ud800",
                    "messages": [{"role": "user", "content": "lone \ud800 surrogate"}]}).encode(),
        b"[1, 2, 3]",  # JSON, but no object
    ]
    for body in hostile:
        assert_dialect_error(path, post(stack, path, body), 400)
    # an empty block list (found by the fuzzer: a 500 once) would drop the message from the conversation
    empty = {"model": model, "max_tokens": 2, "cache_control": {"type": "ephemeral"}, "input": [],
             "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}]}
    r = post(stack, path, json.dumps(empty).encode())
    assert r.status_code < 500 and (r.status_code == 200 or error_problem(path, r.status_code, r.content) is None)
    if path == "/v1/messages":
        assert_dialect_error(path, r, 400)
    # a huge string within the size limit is an ordinary request: refused for its length, never a 5xx
    huge = {"model": model, "max_tokens": 2, "messages": [{**user, "content": "word " * 5_000}],
            "input": "word " * 5_000}
    assert_dialect_error(path, post(stack, path, json.dumps(huge).encode()), 400)


def test_schemathesis_bounded(stack: ServingStack) -> None:
    report = fuzz(stack.base_url, KEY, FuzzConfig(max_examples=8, timeout_s=60))
    assert report.server_errors == report.bad_error_bodies == report.timeouts == 0, report.failures
    assert len(report.operations) >= 13 and min(report.operations.values()) > 0, report.operations
