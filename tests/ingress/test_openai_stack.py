"""The OpenAI dialect end to end on a real stack: nats + S3 + prefill + decode + ingress subprocesses.

Checked with the official `openai` SDK: chat and completions, streaming and
not; `/v1/completions` at temperature 0 gives exactly the in-process
engine's text; a multi-turn conversation hits on every previous turn; two
tenants with the same prompt never share blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvmesh.config import EngineSettings
from kvmesh.stack.servers import S3Server

from ingress.serving_stack import ServingStack, one_of_each

KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
BLOCK = EngineSettings().block_size


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("ingress-stack"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


def client(stack: ServingStack, key: str = "sk-alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def test_chat_stream_equals_non_stream(stack: ServingStack) -> None:
    c = client(stack)
    args = {"model": stack.model_dir.name, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Name three colours of the sea."}]}
    whole = c.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens > 10
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")

    chunks = list(c.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [choice.finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    # the same prompt again: every full block of it comes from the cache
    assert last.usage.prompt_tokens_details.cached_tokens >= (whole.usage.prompt_tokens // BLOCK - 1) * BLOCK > 0


PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there", "1 2 3 4 5 6 7 8"]


def test_completions_identical_to_engine(stack: ServingStack) -> None:
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling import SamplingParams

    loaded = load_model(stack.model_dir)
    engine = Engine(loaded, EngineSettings(num_blocks=256))
    c = client(stack)
    for i, prompt in enumerate(PROMPTS):
        ids = loaded.tokenizer.encode(prompt)
        ref = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
        got = c.completions.create(model=stack.model_dir.name, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == ref.text, f"prompt {i}"
        assert got.usage.completion_tokens == len(ref.token_ids) and got.usage.prompt_tokens == len(ids)
        streamed = c.completions.create(model=stack.model_dir.name, prompt=prompt, max_tokens=16,
                                        temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == ref.text


def test_multi_turn_hits_previous_turn(stack: ServingStack) -> None:
    c = client(stack)
    messages = [{"role": "system", "content": "You are a helpful agent with tools. " * 4}]
    previous = 0  # prompt + answer tokens of the previous turn
    for turn in range(4):
        messages.append({"role": "user", "content": f"Step {turn}: list the files in directory number {turn}."})
        r = c.chat.completions.create(model=stack.model_dir.name, messages=messages, max_tokens=10,
                                      temperature=0, prompt_cache_key="agent-session-1")
        cached = r.usage.prompt_tokens_details.cached_tokens
        if turn:
            # The answer's last token is sampled, never fed back, so its KV exists from the next turn on.
            assert cached >= (previous - 1) // BLOCK * BLOCK, (turn, cached, previous)
        previous = r.usage.prompt_tokens + r.usage.completion_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})


def test_tenants_never_share(stack: ServingStack) -> None:
    args = {"model": stack.model_dir.name, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "A prompt both tenants send, long enough for blocks. " * 3}]}
    a = client(stack, "sk-alpha")
    a.chat.completions.create(**args)
    assert a.chat.completions.create(**args).usage.prompt_tokens_details.cached_tokens > 0
    b = client(stack, "sk-beta").chat.completions.create(**args)
    assert b.usage.prompt_tokens_details.cached_tokens == 0


def test_client_disconnect_aborts_on_the_worker(stack: ServingStack) -> None:
    """Closing the stream early sends an AbortRequest to the worker running the request."""
    import asyncio

    import nats as nats_py
    from kvmesh.protocol import subjects
    from kvmesh.protocol.serving import AbortRequest

    async def scenario() -> tuple[str, list[AbortRequest]]:
        nc = await nats_py.connect(stack.nats.url)
        seen: list[AbortRequest] = []

        async def on_abort(msg) -> None:  # type: ignore[no-untyped-def]
            seen.append(AbortRequest.from_bytes(msg.data))

        await nc.subscribe(subjects.ABORT_ALL, cb=on_abort)
        aclient = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-alpha", max_retries=0)
        async with aclient.completions.with_streaming_response.create(
            model=stack.model_dir.name, prompt="Tell me everything", max_tokens=2000, temperature=0, stream=True,
        ) as response:
            request_id = response.headers["x-request-id"]
            async for _ in await response.parse():
                break  # the client walks away after the first chunk
        for _ in range(50):
            if seen:
                break
            await asyncio.sleep(0.1)
        await nc.close()
        return request_id, seen

    request_id, aborts = asyncio.run(scenario())
    assert [a.request_id for a in aborts] == [request_id]


def test_stop_seed_and_token_limits(stack: ServingStack) -> None:
    c = client(stack)
    model = stack.model_dir.name
    base = {"model": model, "messages": [{"role": "user", "content": "Count the waves."}], "temperature": 0}
    full = c.chat.completions.create(**base, max_tokens=24).choices[0].message.content
    assert len(full) > 6
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = c.chat.completions.create(**base, max_tokens=24, stop=[stop, "never-appears"]).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
    short = c.chat.completions.create(**base, max_completion_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    sampled = {**base, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 16,
               "user": "u-1", "safety_identifier": "hash-1"}
    one = c.chat.completions.create(**sampled).choices[0].message.content
    assert c.chat.completions.create(**sampled).choices[0].message.content == one  # same seed, same tokens


def test_ignore_eos_decodes_past_the_end_of_sequence(stack: ServingStack) -> None:
    """vLLM's `ignore_eos` extra parameter: the same tokens as the engine asked the same, to `max_tokens`."""
    import itertools

    from kvmesh.engine.engine import Engine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling import SamplingParams

    loaded = load_model(stack.model_dir)
    engine = Engine(loaded, EngineSettings(num_blocks=256))
    words = "sea wave fox stop end over the night".split()
    for prompt in (" ".join(w) for w in itertools.product(words, repeat=3)):  # one whose answer ends early
        ids = loaded.tokenizer.encode(prompt)
        ends = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
        if ends.finish_reason == "stop":
            break
    else:
        pytest.fail("no prompt of the list makes the tiny model end early")
    past = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    c = client(stack)
    plain = c.completions.create(model=stack.model_dir.name, prompt=prompt, max_tokens=16, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == len(ends.token_ids) < 16
    got = c.completions.create(model=stack.model_dir.name, prompt=prompt, max_tokens=16, temperature=0,
                               extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 16
    assert got.choices[0].text == past.text

def test_metrics_and_headers(stack: ServingStack) -> None:
    import httpx

    r = httpx.post(f"{stack.base_url}/v1/completions", headers={"authorization": "Bearer sk-alpha",
                                                                "x-session-id": "sess-42"},
                   json={"model": stack.model_dir.name, "prompt": "metrics please", "max_tokens": 2,
                         "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("req_")
    usage = r.json()["usage"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    text = stack.metrics()
    assert 'kvmesh_ingress_requests_total{route="/v1/completions",status="200"}' in text
    assert "kvmesh_ingress_ttft_seconds_count" in text and "kvmesh_ingress_cached_tokens_total" in text
    assert httpx.get(f"{stack.base_url}/readyz").status_code == 200
    public = httpx.get(f"{stack.base_url}/metrics")  # metrics live on the side port only
    assert public.status_code == 404 and public.json()["error"]["type"] == "invalid_request_error"
    assert '"session_id": "sess-42"' in stack.log("ingress-0") or '"session_id":"sess-42"' in stack.log("ingress-0")


def test_sigterm_drains_open_streams(stack: ServingStack) -> None:
    """Runs last: SIGTERM stops new work but a stream already running ends normally; the process exits 0."""
    import signal

    c = client(stack)
    stream = c.completions.create(model=stack.model_dir.name, prompt="Drain me gently, token by token",
                                  max_tokens=200, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    stack.signal("ingress-0", signal.SIGTERM)
    rest = list(chunks)  # the SDK raises if the stream ends in an error or without [DONE]
    assert [ch.choices[0].finish_reason for ch in rest if ch.choices[0].finish_reason] in (["length"], ["stop"])
    assert first.choices[0].text or rest
    assert stack.procs["ingress-0"].proc.wait(timeout=30) == 0

