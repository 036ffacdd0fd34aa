"""Every OpenAI error path on a live ingress: right status, an error object the SDK parses, no job published.

The ingress runs with no workers, so a valid request is the 503 case, and
JOBS' last sequence staying put proves that bad requests published nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ingress.serving_stack import ServingStack, ingress_alone, no_job_published

KEY, TENANT = "sk-test-errors", "acme"
LIMITED_KEY = "sk-test-limited"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServingStack]:
    with ingress_alone(tmp_path_factory.mktemp("ingress-errors"), tiny_model_dir,
                       {KEY: TENANT, LIMITED_KEY: "limited"}, KVMESH_INGRESS__MAX_BODY_BYTES="65536",
                       KVMESH_INGRESS__RATE_LIMIT_PER_S="0.5", KVMESH_INGRESS__RATE_LIMIT_BURST="40") as s:
        yield s


@pytest.fixture
def client(stack: ServingStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def no_jobs(stack: ServingStack) -> Iterator[None]:
    with no_job_published(stack):
        yield


def model_id(stack: ServingStack) -> str:
    return stack.model_dir.name


def chat(client: openai.OpenAI, stack: ServingStack, **kw: object) -> object:
    args = {"model": model_id(stack), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    args.update(kw)
    return client.chat.completions.create(**args)  # type: ignore[call-overload]


def test_missing_and_invalid_key_401(stack: ServingStack, no_jobs: None) -> None:
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json={"model": model_id(stack), "messages": []})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["x-request-id"].startswith("req_")
    bad = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        chat(bad, stack)
    assert err.value.status_code == 401 and err.value.request_id


def test_models_lists_the_model(client: openai.OpenAI, stack: ServingStack) -> None:
    assert [m.id for m in client.models.list().data] == [model_id(stack)]


def test_unknown_model_404(client: openai.OpenAI, stack: ServingStack, no_jobs: None) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        chat(client, stack, model="gpt-nothing")
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_malformed_json_400(stack: ServingStack, no_jobs: None) -> None:
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", content=b"{not json",
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("bad", [
    {"temperature": 7.0},
    {"n": 2},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"max_tokens": 0},
    {"stop": ["a", "b", "c", "d", "e"]},
])
def test_bad_field_400(client: openai.OpenAI, stack: ServingStack, no_jobs: None, bad: dict) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, stack, **bad)
    assert err.value.status_code == 400 and err.value.param


def test_context_overflow_400(client: openai.OpenAI, stack: ServingStack, no_jobs: None) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, stack, max_tokens=5000)
    assert "context" in err.value.message and err.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id(stack), prompt="word " * 5000, max_tokens=1)


def test_body_too_large_413(client: openai.OpenAI, stack: ServingStack, no_jobs: None) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        chat(client, stack, messages=[{"role": "user", "content": "x" * 100_000}])
    assert err.value.status_code == 413 and err.value.code == "request_too_large"


def test_rate_limit_429_with_retry_after(stack: ServingStack, no_jobs: None) -> None:
    headers = {"authorization": f"Bearer {LIMITED_KEY}"}
    statuses = []
    with httpx.Client(base_url=stack.base_url, headers=headers) as http:
        for _ in range(45):  # burst 40: the bucket runs dry within the loop
            r = http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
            statuses.append(r.status_code)
            if r.status_code == 429:
                break
    assert statuses[-1] == 429, statuses
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_exceeded"
    limited = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=LIMITED_KEY, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        chat(limited, stack)


def test_no_live_worker_503(client: openai.OpenAI, stack: ServingStack, no_jobs: None) -> None:
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as err:
            chat(client, stack, stream=stream)
        assert err.value.status_code == 503 and err.value.code == "overloaded"
    assert httpx.get(f"{stack.base_url}/readyz").status_code == 503


def test_unknown_route_404_has_request_id(stack: ServingStack) -> None:
    r = httpx.get(f"{stack.base_url}/v1/nothing-here")
    assert r.status_code == 404 and r.headers["x-request-id"] and r.json()["error"]["message"]
