"""`kvmesh up`: the local stack with vLLM as its workers' engine, the default where vLLM is installed
(shared/workers/vllm_backend.py).

The real CLI with its default engine (no --engine, no KVMESH_* settings but the test's), the real default model, NATS with
users, the S3 server, and the official OpenAI SDK against the ingress: a repeated prompt hits, JSON mode and a
required tool call come out valid (kvmesh's grammars in vLLM's llguidance backend), a stopped and
restarted stack (vLLM's pool and prefix cache empty) restores the prompt from kvmesh's tiers, and the
worker's KV events named the blocks vLLM computed, under the worker's own id. Restarted with a vLLM decode
worker and every request handed off, the answer is the same, its KV read from the prefill worker's L2.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import nats
import nats.js.errors
import pytest
from kvmesh.bus.client_auth import connect_kwargs
from kvmesh.credentials.nats import admin_auth
from kvmesh.eviction.messages import Retain, WorkerCommand
from kvmesh.kv_events.events import BlockStored, KVEventBatch
from kvmesh.net import free_port
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.streams import KV_EVENTS
from kvmesh.stack.model import default_model_dir
from kvmesh.stack.procs import descendants, is_ours
from kvmesh.stack.state import load_state
from openai import OpenAI
from test_vllm_connector import vllm_python
from waits import until_sync

KEY = "sk-vllm-fleet"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SYSTEM = " ".join(f"Rule {i}: answer in one short sentence and never mention the number {i * 7}." for i in range(24))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_dir(tmp_path_factory.mktemp("state"))


class Stack:
    """`kvmesh` on one state dir; whatever it started is SIGKILLed at the end."""

    def __init__(self, state_dir: Path, port: int) -> None:
        self.kvmesh = str(Path(vllm_python()).parent / "kvmesh")
        self.state_dir = state_dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")} | {
            "KVMESH_STATE_DIR": str(state_dir), "KVMESH_INGRESS__PORT": str(port), "KVMESH_API_KEYS": f"{KEY}:a",
            "KVMESH_STACK__STOP_GRACE_S": "20", "KVMESH_ENGINE__NUM_BLOCKS": "512"}
        self.ports = [str(free_port()) for _ in range(3)]
        self.pids: set[int] = set()

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        out = subprocess.run([self.kvmesh, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        state = load_state(self.state_dir)
        if state is not None:
            self.pids |= {r.pid for r in state.processes if is_ours(r)}
        return out

    def up(self, model: Path, *more: str) -> None:
        nats_port, monitor_port, s3_port = self.ports
        out = self.cli("up", "--detach", "--model", str(model), "--timeout", "600",
                       "--nats-port", nats_port, "--nats-monitor-port", monitor_port, "--s3-port", s3_port, *more,
                       timeout=700)
        assert out.returncode == 0, out.stderr[-3000:] + self.logs()

    def down(self) -> None:
        assert self.cli("down").returncode == 0

    def logs(self, worker: str = "prefill-0") -> str:
        log = self.state_dir / "logs" / f"{worker}.log"
        return "\n" + log.read_text()[-4000:] if log.exists() else ""

    def log_lines(self, worker: str, text: str) -> list[str]:
        return [line for line in (self.state_dir / "logs" / f"{worker}.log").read_text().splitlines() if text in line]

    def log_events(self, worker: str, event: str) -> list[dict]:
        return [e for line in self.log_lines(worker, event) if line.startswith("{")
                if (e := json.loads(line)).get("event") == event]

    def kill_leftovers(self) -> None:
        """SIGKILL what it started and what that started: vLLM's workers outlive a killed parent."""
        for pid in [child for pid in self.pids for child in descendants(pid)] + list(self.pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def _stored_by(state_dir: Path, worker_id: str) -> dict[Tier, list[str]]:
    """The blocks `worker_id` reported stored, by tier, in the order it reported them, from the KV_EVENTS stream
    (as the admin user)."""
    state = load_state(state_dir)
    assert state is not None
    nc = await nats.connect(**connect_kwargs(state.nats_url, admin_auth(state_dir)))
    found: dict[Tier, dict[str, None]] = {}
    try:
        js = nc.jetstream()
        info = await js.stream_info(KV_EVENTS.name)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await js.get_msg(KV_EVENTS.name, seq)
            except nats.js.errors.NotFoundError:
                continue
            if msg.subject != subjects.kv_events(worker_id):
                continue
            for e in KVEventBatch.from_bytes(msg.data).events:
                if isinstance(e, BlockStored):
                    found.setdefault(e.tier, {}).update(dict.fromkeys(e.hashes))
    finally:
        await nc.close()
    return {tier: list(hashes) for tier, hashes in found.items()}


async def _advise(state_dir: Path, worker_id: str, cmd) -> str:
    """Publish an eviction command to `worker_id`, as the eviction service does (as the admin user); its id."""
    state = load_state(state_dir)
    assert state is not None
    nc = await nats.connect(**connect_kwargs(state.nats_url, admin_auth(state_dir)))
    try:
        command = WorkerCommand(worker=worker_id, command_id=f"test-{cmd.kind}-{time.time_ns()}", command=cmd)
        await nc.jetstream().publish(subjects.commands(worker_id), command.to_bytes(),
                                     headers={subjects.HDR_MSG_ID: command.command_id})
    finally:
        await nc.close()
    return command.command_id


def _ask(port: int, model: Path, question: str, **kw):
    return _ask_raw(port, model, question, **kw).parse()


def _ask_raw(port: int, model: Path, question: str, max_tokens: int = 12, **kw):
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=300)
    return client.chat.completions.with_raw_response.create(model=model.name, max_tokens=max_tokens, temperature=0,
                                                            messages=[{"role": "system", "content": SYSTEM},
                                                                      {"role": "user", "content": question}], **kw)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kvmesh_up_with_vllm_serves_hits_restores_after_a_restart_and_hands_off(model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    port = free_port()
    stack = Stack(tmp_path / "state", port)
    try:
        stack.up(model_dir)
        first = _ask(port, model_dir, "Is it raining?")
        again = _ask(port, model_dir, "Is it raining?")
        text = first.choices[0].message.content
        assert text and first.usage.completion_tokens > 0
        assert again.choices[0].message.content == text
        prompt_tokens = first.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - 32  # all but the last block
        # constrained decoding runs kvmesh's grammars in vLLM: JSON mode parses, a required tool call validates
        as_json = _ask(port, model_dir, "Is it raining?", max_tokens=64, response_format={"type": "json_object"})
        assert isinstance(json.loads(as_json.choices[0].message.content), dict), as_json
        called = _ask(port, model_dir, "What is the weather in Paris?", max_tokens=64, tools=[WEATHER],
                      tool_choice="required")
        [call] = called.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
        assert called.choices[0].finish_reason == "tool_calls"
        stored = asyncio.run(_stored_by(stack.state_dir, "prefill-0"))
        assert len(stored.get(Tier.L2, [])) >= (prompt_tokens - 1) // 32, stored  # the index learned vLLM's blocks
        # the eviction service's advice reaches the connector inside vLLM (the service's own session retains
        # too, in the same log): keep this chain in L2
        chain = stored[Tier.L2][:(prompt_tokens - 1) // 32]
        sent = asyncio.run(_advise(stack.state_dir, "prefill-0", Retain(hashes=chain, until=time.time() + 600)))
        [applied] = until_sync(lambda: [x for x in stack.log_lines("prefill-0", "advice applied") if sent in x],
                               60, "the advice applied")
        assert f"retained={len(chain)}" in applied, applied
        stack.down()

        # New processes (vLLM's pool and prefix cache start empty), now with a vLLM decode worker that every
        # request is handed to: the prefill worker restores the prompt from L3 and computes the first token,
        # the decode worker's connector loads the prompt's KV out of the prefill worker's L2 slab. (The eviction
        # service would warm the new workers' L2 from L3 first, and the decode worker would load from its own L2:
        # no warm-up here, so what is read is the prefill worker's slab.)
        stack.env["KVMESH_INGRESS__DECODE_PLACEMENT"] = "split"
        stack.env["KVMESH_EVICTION__WARM_MAX_CHUNKS"] = "0"
        stack.up(model_dir, "--decode", "1")
        raw = _ask_raw(port, model_dir, "Is it raining?")
        restored = raw.parse()
        assert "prefill=prefill-0;decode=decode-0" in raw.headers["kvmesh-route"]
        assert restored.choices[0].message.content == text, stack.logs("decode-0")
        assert restored.usage.prompt_tokens_details.cached_tokens >= prompt_tokens // 2, stack.logs()
        assert asyncio.run(_stored_by(stack.state_dir, "prefill-0")).get(Tier.L3)
        [handed] = stack.log_events("prefill-0", "prefilled")
        assert handed["handles"] == prompt_tokens // 32 and handed["decode_worker"] == "decode-0"
        [decoded] = stack.log_events("decode-0", "decoded")
        assert decoded["resumed_from"] == 1 and decoded["peers"] == ["prefill-0"]
        assert decoded["engine_cached_tokens"] == prompt_tokens // 32 * 32, stack.logs("decode-0")
        # the connector logs from vLLM's engine process, in structlog's console format
        loads = stack.log_lines("decode-0", "kv loaded")
        assert len(loads) == 1 and f"tiers={{'PEER': {prompt_tokens // 32}}}" in loads[0], loads
        stack.down()
    finally:
        stack.kill_leftovers()
