"""Decode placement "priced" through the ingress: on one host a request decodes on its prefill worker.

A real stack (two prefill workers, one decode worker, all on loopback: one host) with
`decode_placement=priced`. The route header names the prefill worker as the decode worker too, and
a prefill worker SIGKILLed while it decodes a request migrates it to the decode worker: the client's
stream goes on with exactly the tokens it would have had, none duplicated or missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvmesh.stack.servers import S3Server
from waits import until_sync

from ingress.serving_stack import ServingStack, ingress_retries, key_homed_on, own_nats, stream_killing

KEY = "sk-placement"
PREFILLS = ["prefill-0", "prefill-1"]
LONG = 400  # tokens: long enough that a kill lands mid-stream


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with own_nats(tmp_path_factory.mktemp("decode-placement"), s3_server, tiny_model_dir, {KEY: "placement"},
                  bucket="kvmesh-decode-placement", KVMESH_INGRESS__DECODE_PLACEMENT="priced",
                  KVMESH_INGRESS__INTER_TOKEN_TIMEOUT_S="5") as s:
        for worker in PREFILLS:
            s.start("prefill", worker)
        s.start("decode", "decode-0")
        s.start_ready("ingress", "ingress-0")
        c = _client(s)
        for worker in PREFILLS:  # ready needs one live prefill worker: wait until the ingress routes to each

            def routed(key: str = key_homed_on(PREFILLS, worker), worker: str = worker) -> bool:
                raw = c.completions.with_raw_response.create(model=s.model_dir.name, prompt="ping", max_tokens=1,
                                                             extra_body={"prompt_cache_key": key})
                return f"prefill={worker}" in raw.headers["kvmesh-route"]

            until_sync(routed, 60, f"requests homed on {worker} routed there", poll_s=0.3)
        yield s


def _client(stack: ServingStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_one_host_decodes_on_the_prefill_worker(stack: ServingStack) -> None:
    c = _client(stack)
    key = key_homed_on(PREFILLS, "prefill-1")
    history = [{"role": "user", "content": "Where does a request decode when every worker shares one box?"}]

    def turn(max_tokens: int):
        raw = c.chat.completions.with_raw_response.create(model=stack.model_dir.name, messages=history,
                                                          max_tokens=max_tokens, temperature=0,
                                                          extra_body={"prompt_cache_key": key})
        return raw.headers["kvmesh-route"], raw.parse()

    route, first = turn(16)
    assert "prefill=prefill-1;decode=prefill-1" in route
    # The next turn finds prompt and answer (all but its last token's KV) in the same worker's pool.
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And when they do not?"}]
    route, second = turn(8)
    assert "decode=prefill-1" in route
    answered = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens >= answered // 16 * 16 > first.usage.prompt_tokens // 16 * 16


def test_prefill_worker_killed_while_decoding_migrates_exactly(stack: ServingStack) -> None:
    c = _client(stack)
    key = key_homed_on(PREFILLS, "prefill-0")
    for i in range(20):
        prompt = f"Write a very long story, number {i}, about the harbour:"
        raw = c.completions.with_raw_response.create(model=stack.model_dir.name, prompt=prompt, max_tokens=LONG,
                                                     temperature=0, extra_body={"prompt_cache_key": key})
        route, ref = raw.headers["kvmesh-route"], raw.parse()
        if ref.choices[0].finish_reason == "length":
            break
    else:
        pytest.fail("no prompt generates LONG tokens without eos")
    assert "decode=prefill-0" in route
    before = ingress_retries(stack)
    text, finish = stream_killing(stack, c, "prefill-0", "prefill=prefill-0;decode=prefill-0",
                                  model=stack.model_dir.name, prompt=prompt, max_tokens=LONG, temperature=0,
                                  extra_body={"prompt_cache_key": key})
    assert text == ref.choices[0].text
    assert finish == "length"
    assert ingress_retries(stack) == before + 1
