"""`kvmesh chat` piped: two lines in, two streamed answers with per-turn cache stats out, on a live stack."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh.config import EngineSettings
from kvmesh.stack.servers import S3Server

from ingress.serving_stack import ServingStack, one_of_each

KEYS = {"sk-chat": "chat"}
BLOCK = EngineSettings().block_size
KVMESH = str(Path(sys.executable).parent / "kvmesh")
STATS = re.compile(r"\[cached (\d+)/(\d+) prompt tokens · (\d+) generated · TTFT (\d+) ms\]")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("chat-stack"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


def test_piped_chat_reads_state_dir_and_shows_cache_hits(stack: ServingStack, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "api_keys").write_text("sk-chat:chat\n")  # the keys file the ingress reads by default
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(KVMESH_STATE_DIR=str(state), KVMESH_INGRESS__PORT=str(stack.ingress_port))
    out = subprocess.run([KVMESH, "chat", "--system", "You are a patient tutor.", "--max-tokens", "8"],
                         input="Explain what a prefix cache is.\nAnd why does it help agents?\n",
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    turns = [tuple(map(int, m.groups())) for m in STATS.finditer(out.stdout)]
    assert len(turns) == 2, out.stdout
    (cached1, prompt1, gen1, _), (cached2, prompt2, gen2, _) = turns
    assert cached1 <= prompt1 and gen1 >= 1 and gen2 >= 1
    assert prompt2 > prompt1 + gen1
    assert cached2 >= (prompt1 + gen1 - 1) // BLOCK * BLOCK  # turn 2 hits on turn 1's prompt and answer


def test_chat_without_a_key_says_how_to_get_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["KVMESH_STATE_DIR"] = str(tmp_path)
    out = subprocess.run([KVMESH, "chat"], input="hi\n", env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no API key" in out.stderr
