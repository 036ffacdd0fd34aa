"""The Anthropic dialect end to end with the official `anthropic` SDK on a real stack.

nats + S3 + prefill + decode + ingress subprocesses (tests/ingress/serving_stack.py).
The SDK no longer sends `temperature`, so greedy runs pass it in `extra_body`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from kvmesh.config import EngineSettings
from kvmesh.stack.servers import S3Server

from ingress.serving_stack import ServingStack, one_of_each

KEYS = {"sk-anth-a": "anth-a", "sk-anth-b": "anth-b"}
BLOCK = EngineSettings().block_size
GREEDY = {"extra_body": {"temperature": 0}}
EPH = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("anthropic-stack"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


def client(stack: ServingStack, key: str = "sk-anth-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key=key, max_retries=0, timeout=60)


def unique(text: str) -> str:
    """A prefix no earlier test cached (the stack is shared by the module)."""
    return f"[{uuid.uuid4().hex}] {text}"


def test_message_stream_equals_non_stream(stack: ServingStack) -> None:
    c = client(stack)
    args = {"model": stack.model_dir.name, "max_tokens": 12, "system": "You are terse.",
            "messages": [{"role": "user", "content": "Name three colours of the sea."}], **GREEDY}
    raw = c.messages.with_raw_response.create(**args)
    assert raw.headers["request-id"].startswith("req_")
    msg = raw.parse()
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "text" and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens >= 1
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 10

    with c.messages.stream(**args) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == msg.content[0].text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens
    # the same prompt again: its full blocks are read from the cache
    total = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens >= (total // BLOCK - 1) * BLOCK > 0

    # raw SSE: the event names and the ping the SDK hides
    with httpx.stream("POST", f"{stack.base_url}/v1/messages", json={**args.pop("extra_body"), **args, "stream": True},
                      headers={"x-api-key": "sk-anth-a", "anthropic-version": "2023-06-01"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_same_text_as_openai_dialect(stack: ServingStack) -> None:
    """Both dialects render one conversation to the same prompt: greedy answers are identical."""
    system, user = "You answer in one line.", "What is a KV cache?"
    a = client(stack).messages.create(model=stack.model_dir.name, max_tokens=10, system=system,
                                      messages=[{"role": "user", "content": user}], **GREEDY)
    o = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-anth-a", max_retries=0)
    r = o.chat.completions.create(model=stack.model_dir.name, max_tokens=10, temperature=0,
                                  messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    assert a.content[0].text == r.choices[0].message.content
    assert a.usage.output_tokens == r.usage.completion_tokens


def test_breakpoint_multi_turn(stack: ServingStack) -> None:
    c = client(stack)
    system = [{"type": "text", "text": unique("You are a coding agent working in a repository. " * 5),
               "cache_control": EPH}]
    tools = [{"name": "read_file", "description": "Read a file.", "cache_control": {**EPH, "ttl": "1h"},
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    messages: list[dict] = [{"role": "user", "content": "Open the README."}]
    first = c.messages.create(model=stack.model_dir.name, max_tokens=8, system=system, tools=tools,
                              messages=messages, **GREEDY)
    u1 = first.usage
    assert u1.cache_read_input_tokens == 0
    assert u1.cache_creation.ephemeral_1h_input_tokens > 0 and u1.cache_creation.ephemeral_5m_input_tokens > 0
    assert u1.cache_creation_input_tokens == (u1.cache_creation.ephemeral_1h_input_tokens
                                              + u1.cache_creation.ephemeral_5m_input_tokens)
    assert u1.input_tokens > 0  # the user turn after the last breakpoint
    previous = u1.input_tokens + u1.cache_creation_input_tokens + u1.output_tokens
    messages += [{"role": "assistant", "content": first.content[0].text},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "# README"},
                                              {"type": "text", "text": "Summarise it.", "cache_control": EPH}]}]
    second = c.messages.create(model=stack.model_dir.name, max_tokens=8, system=system, tools=tools,
                               messages=messages, **GREEDY)
    u2 = second.usage
    assert u2.cache_read_input_tokens >= u1.cache_creation_input_tokens
    assert u2.cache_read_input_tokens >= (previous - 1) // BLOCK * BLOCK  # turn 1's prompt and answer
    assert u2.cache_creation.ephemeral_5m_input_tokens > 0 and u2.cache_creation.ephemeral_1h_input_tokens == 0


def test_stop_sequence(stack: ServingStack) -> None:
    c = client(stack)
    args = {"model": stack.model_dir.name, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Count slowly, please."}], **GREEDY}
    text = c.messages.create(**args).content[0].text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].isascii() and text[i:i + 2].isalnum())
    cut = c.messages.create(**args, stop_sequences=["never-seen-zz", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_assistant_prefill_is_continued(stack: ServingStack) -> None:
    c = client(stack)
    base = [{"role": "user", "content": "Say something."}]
    first = c.messages.create(model=stack.model_dir.name, max_tokens=8, messages=base, **GREEDY)
    full = first.content[0].text
    head = full[: len(full) // 2].rstrip()
    assert head
    cont = c.messages.create(model=stack.model_dir.name, max_tokens=4,
                             messages=[*base, {"role": "assistant", "content": head}], **GREEDY)
    assert cont.content[0].text and cont.usage.output_tokens >= 1  # only the continuation comes back
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    # the prefill comes after the generation prompt: the prompt grows by its tokens
    assert cont.usage.input_tokens + cont.usage.cache_read_input_tokens > prompt

def test_count_tokens_matches_the_prompt(stack: ServingStack) -> None:
    c = client(stack)
    args = {"model": stack.model_dir.name, "system": "You are terse.",
            "messages": [{"role": "user", "content": "How many tokens is this?"}]}
    counted = c.messages.count_tokens(**args).input_tokens
    used = c.messages.create(**args, max_tokens=2, **GREEDY).usage
    assert counted == used.input_tokens + used.cache_read_input_tokens + used.cache_creation_input_tokens > 5

def test_errors_in_anthropic_shape(stack: ServingStack) -> None:
    model = stack.model_dir.name
    msgs = [{"role": "user", "content": [{"type": "text", "text": f"part {i}", "cache_control": EPH}
                                         for i in range(5)]}]
    with pytest.raises(anthropic.BadRequestError) as err:
        client(stack).messages.create(model=model, max_tokens=4, messages=msgs)
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.response.headers["request-id"].startswith("req_")
    late = [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": EPH},
                                         {"type": "text", "text": "b", "cache_control": {**EPH, "ttl": "1h"}}]}]
    with pytest.raises(anthropic.BadRequestError):
        client(stack).messages.create(model=model, max_tokens=4, messages=late)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(stack, "sk-wrong").messages.create(model=model, max_tokens=4, messages=late)
    assert auth.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": "invalid API key"}}
    r = httpx.post(f"{stack.base_url}/v1/messages", json={"model": model, "max_tokens": 4, "messages": late})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and "request-id" in r.headers
    with pytest.raises(anthropic.NotFoundError) as nf:
        client(stack).messages.create(model="no-such-model", max_tokens=4,
                                      messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):  # prompt + max_tokens over the context
        client(stack).messages.create(model=model, max_tokens=10**6, messages=[{"role": "user", "content": "hi"}])
    bad = httpx.post(f"{stack.base_url}/v1/messages", content=b"{not json", headers={"x-api-key": "sk-anth-a"})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    with pytest.raises(anthropic.NotFoundError):  # a named cache that does not exist
        client(stack).messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                      extra_body={"cache_id": "cache_missing"})


def test_tenants_never_share(stack: ServingStack) -> None:
    args = {"model": stack.model_dir.name, "max_tokens": 4, **GREEDY,
            "system": [{"type": "text", "text": unique("Shared words both tenants send. " * 6), "cache_control": EPH}],
            "messages": [{"role": "user", "content": "hello"}]}
    client(stack, "sk-anth-a").messages.create(**args)
    assert client(stack, "sk-anth-a").messages.create(**args).usage.cache_read_input_tokens > 0
    b = client(stack, "sk-anth-b").messages.create(**args)
    assert b.usage.cache_read_input_tokens == 0 and b.usage.cache_creation_input_tokens > 0


def test_decode_lost_mid_stream_is_an_error_event_then_529(stack: ServingStack) -> None:
    """Runs last: kills the only decode worker mid-stream. No other worker to migrate to, so the stream
    ends with an `error` event (never a silent message_stop), and new requests get 529 until one is back."""
    import signal

    model = stack.model_dir.name
    body = {"model": model, "max_tokens": 3000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    headers = {"x-api-key": "sk-anth-a"}
    with httpx.stream("POST", f"{stack.base_url}/v1/messages", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        events: list[str] = []
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
                if events.count("content_block_delta") == 3:
                    stack.signal("decode-0", signal.SIGKILL)
            if line.startswith("data: ") and events and events[-1] == "error":
                error = json.loads(line.removeprefix("data: "))
    assert events[-1] == "error" and "message_stop" not in events, events[-5:]
    assert error["type"] == "error" and error["error"]["type"] in ("overloaded_error", "api_error")
    with pytest.raises(anthropic.APIStatusError) as over:
        client(stack).messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert over.value.status_code == 529 and over.value.body["error"]["type"] == "overloaded_error"
