"""Served traffic end to end: a real stack (nats + S3 + prefill + decode + ingress + eviction, tiny model),
the official SDKs as clients, the recording read back by `kvmesh trace record`, replayed by `kvmesh sim`,
and the eviction service's live Belady gauge held to the sim's Belady on that recording."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import nats
import openai
import pytest
from ingress.serving_stack import ServingStack, one_of_each
from kvmesh.cli.main import app
from kvmesh.config import load_settings
from kvmesh.protocol.traffic import session_tag, tenant_tag
from kvmesh.stack.belady_status import parse_gauges
from kvmesh.stack.servers import S3Server
from kvmesh.stack.state import Endpoint, StackState, save_state
from kvmesh.stack.status import stack_status
from kvmesh.traffic.reader import read_records
from typer.testing import CliRunner

KEYS = {"sk-acme": "acme", "sk-bravo": "bravo"}
L1_BLOCKS = 8  # the live Belady's what-if fleet L1: small, so Belady has to choose
STORY = ("Tell me about the lighthouse keeper Marguerite who counted ships along the northern cape every "
         "night for forty years and wrote each one into a blue ledger. ")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}}]
runner = CliRunner()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    env = {"KVMESH_EVICTION__LIVE_BELADY__PERIOD_S": "0.2", "KVMESH_EVICTION__LIVE_BELADY__CAPACITY_BLOCKS": str(L1_BLOCKS)}
    with one_of_each(tmp_path_factory.mktemp("traffic"), s3_server, tiny_model_dir, KEYS, **env) as s:
        s.start_ready("eviction", "eviction-0")
        yield s


def records_when(nats_url: str, count: int, timeout_s: float = 60.0) -> list:
    """The stream's records once it holds `count` of them (they are published after each response)."""
    async def read() -> list:
        nc = await nats.connect(nats_url)
        try:
            return await read_records(nc.jetstream(), None)
        finally:
            await nc.close()

    deadline = time.monotonic() + timeout_s
    while len(got := asyncio.run(read())) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} traffic records arrived"
        time.sleep(0.1)
    return got


def gauges_when(stack: ServingStack, accesses: int, timeout_s: float = 60.0) -> dict[str, float]:
    """The live Belady gauges once a pass has seen `accesses` block accesses (the whole recording)."""
    deadline = time.monotonic() + timeout_s
    while (g := parse_gauges(stack.metrics("eviction-0"))).get("window_accesses") != accesses:
        assert time.monotonic() < deadline, f"live belady window never reached {accesses}: {g}"
        time.sleep(0.1)
    return g


def test_recorded_trace_replays_and_live_belady_equals_the_sim(stack: ServingStack, tmp_path: Path) -> None:
    model = stack.model_dir.name
    acme = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-acme", max_retries=0, timeout=120)
    bravo = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-bravo", max_retries=0, timeout=120)
    first = [{"role": "user", "content": STORY * 3}]
    chat = {"model": model, "max_tokens": 6, "temperature": 0, "extra_headers": {"x-session-id": "chat-1"}}
    t1 = acme.chat.completions.create(messages=first, **chat)
    second = [*first, {"role": "assistant", "content": t1.choices[0].message.content or ""},
              {"role": "user", "content": "And what did she write on the last page?"}]
    t2 = acme.chat.completions.create(messages=second, **chat)
    tool = acme.chat.completions.create(model=model, max_tokens=60, temperature=0, tools=TOOLS,
                                        tool_choice="required", messages=[{"role": "user", "content": STORY}],
                                        extra_headers={"x-session-id": "agent-7"})
    other = bravo.chat.completions.create(messages=first, **chat)
    claude = anthropic.Anthropic(base_url=stack.base_url, api_key="sk-acme", max_retries=0, timeout=120)
    msg = claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": STORY * 2}])

    records = records_when(stack.nats.url, 5)
    assert len(records) == 5
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    side = f"http://127.0.0.1:{stack.side_ports['eviction-0']}"
    save_state(StackState(state_dir=str(state_dir), launcher_pid=os.getpid(), launcher_ticks=0, detached=True,
                          nats_url=stack.nats.url, endpoints=[Endpoint(name="eviction-0", url=side, check="http",
                                                                       ready_path="/readyz")]))
    out = tmp_path / "recorded.jsonl"
    done = runner.invoke(app, ["trace", "record", "--out", str(out), "--state-dir", str(state_dir)])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output.strip().splitlines()[-1])["requests"] == 5
    text = out.read_text()
    assert "acme" not in text and "bravo" not in text and "lighthouse" not in text and "chat-1" not in text
    lines = [json.loads(x) for x in text.splitlines()]
    assert [x["timestamp"] for x in lines] == sorted(x["timestamp"] for x in lines) and lines[0]["timestamp"] == 0
    l1, l2, lt, lo, lm = lines  # arrival order is the order they were sent (one after the other)

    for line, resp in ((l1, t1), (l2, t2), (lt, tool), (lo, other)):
        assert line["api"] == "openai.chat" and line["block_tokens"] == 16 and line["worker"] == "prefill-0"
        assert line["input_length"] == resp.usage.prompt_tokens
        assert line["output_length"] == resp.usage.completion_tokens
        assert line["cached_tokens"] == resp.usage.prompt_tokens_details.cached_tokens
        assert sum(line["tier_tokens"].values()) == line["cached_tokens"]
        assert len(line["hash_ids"]) == line["input_length"] // 16 and line["ttft_ms"] > 0
    assert lm["api"] == "anthropic.messages" and lm["output_length"] == msg.usage.output_tokens
    assert {x["tenant"] for x in (l1, l2, lt, lm)} == {tenant_tag("acme")} and lo["tenant"] == tenant_tag("bravo")
    assert l1["session_id"] == l2["session_id"] == session_tag("acme", "chat-1")
    assert lt["session_id"] == session_tag("acme", "agent-7") and lo["session_id"] != l1["session_id"]
    assert lt["tool_calls"] == [c.function.name for c in tool.choices[0].message.tool_calls or []] == ["get_weather"]
    assert l1["tool_calls"] == l2["tool_calls"] == [] and lt["finish_reason"] == "tool_calls"
    # turn 2 extends turn 1: the same chain up to the block turn 1's generation prompt changed, then cached
    shared = len(l1["hash_ids"]) - 1
    assert shared >= 4 and l2["hash_ids"][:shared] == l1["hash_ids"][:shared]
    assert l2["cached_tokens"] >= 16 * shared
    assert not set(lo["hash_ids"]) & set(l1["hash_ids"])  # the same prompt, another tenant: nothing shared

    sim = runner.invoke(app, ["sim", "--trace", str(out), "--l1-blocks", str(L1_BLOCKS), "--policy", "belady",
                              "--policy", "infinite", "--json"])
    assert sim.exit_code == 0, sim.output
    replay = json.loads(sim.output.strip().splitlines()[-1])
    assert replay["unique_blocks"] == len({h for x in lines for h in x["hash_ids"]})

    total = sum(len(x["hash_ids"]) for x in lines)
    live = gauges_when(stack, total)
    assert live["capacity_blocks"] == L1_BLOCKS  # the what-if capacity, not the worker's pool
    assert live["belady"] == pytest.approx(replay["hit_rate"]["belady"], abs=1e-6)
    assert live["infinite"] == pytest.approx(replay["hit_rate"]["infinite"], abs=1e-6)
    assert 0 < live["belady"] < live["infinite"]  # the small pool makes Belady choose
    actual = sum(min(len(x["hash_ids"]), x["tier_tokens"]["l1"] // 16) for x in lines) / total
    assert live["actual"] == pytest.approx(actual)
    shown = stack_status(load_settings(), state_dir).cache_belady
    assert shown["belady"] == live["belady"] and shown["window_accesses"] == total
