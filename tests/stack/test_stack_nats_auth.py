"""`kvmesh up` with NATS users (the default): every service on its own user, a chat completion and a cache hit.

The real services package and the tiny checkpoint; the client is the official
OpenAI SDK. Afterwards the NATS log must hold no permission violation: the
table (shared/bus/permissions.py) covers everything the services really do.
"""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import nats
import nats.errors
import pytest
from kvmesh.credentials.nats import NATS_CREDENTIALS_FILE
from kvmesh.net import free_port
from kvmesh.stack.state import StackState
from openai import OpenAI
from stack_harness import StackDir, admin_nats

KEY = "sk-kvmesh-auth-test"
SERVICES = {"cache_index-0", "decode-0", "eviction-0", "ingress-0", "prefill-0"}
SYSTEM = "You are a careful assistant. Answer every question about the weather, trains and tea in full detail."


def _private(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) == 0o600


def _env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def _anonymous_refused(url: str) -> str:
    with pytest.raises(nats.errors.Error) as refused:
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0)
    return str(refused.value).lower()


async def _workers_seen_by_admin(state: StackState) -> set[str]:
    nc = await nats.connect(**admin_nats(state))
    try:
        return set(await (await nc.jetstream().key_value("workers")).keys())
    finally:
        await nc.close()


@pytest.mark.slow
def test_the_stack_with_nats_users_serves_and_hits_the_cache(stack: StackDir, tiny_model_dir: Path) -> None:
    port = free_port()
    stack.env.update(KVMESH_STACK__SERVICES_PACKAGE="kvmesh.services", KVMESH_INGRESS__PORT=str(port),
                     KVMESH_API_KEYS=f"{KEY}:tenant-a")
    out = stack.cli(*stack.up_args("--detach", "--model", str(tiny_model_dir), "--timeout", "240"), timeout=300)
    assert out.returncode == 0, out.stderr
    state = stack.state()
    assert state is not None
    try:
        users = json.loads((stack.state_dir / NATS_CREDENTIALS_FILE).read_text())["users"]
        assert set(users) == SERVICES | {"admin", "vllm"}  # vllm: for vLLM instances with the connector
        assert _private(stack.state_dir / NATS_CREDENTIALS_FILE) and _private(stack.state_dir / "nats" / "nats.conf")
        for rec in state.processes:
            if rec.kind == "service":  # each replica connects as the user named after its worker id
                env = _env_of(rec.pid)
                assert env["KVMESH_NATS_USER"] == rec.name and env["KVMESH_NATS_PASSWORD"] == users[rec.name]["password"]
        assert "authorization violation" in asyncio.run(_anonymous_refused(state.nats_url))
        assert SERVICES <= asyncio.run(_workers_seen_by_admin(state))  # every heartbeat went through

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is it raining?"}]
        first = client.chat.completions.create(model=tiny_model_dir.name, messages=messages, max_tokens=8,
                                               temperature=0)
        again = client.chat.completions.create(model=tiny_model_dir.name, messages=messages, max_tokens=8,
                                               temperature=0)
        assert first.choices[0].message.content and first.usage.completion_tokens == 8
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        assert stack.cli("down").returncode == 0
    log = (stack.state_dir / "nats" / "nats.log").read_text()
    assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line][:5]
