"""The report tests' stack fixture: the stack harness of tests/stack, running the real services package."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "stack"))
from stack_harness import StackDir  # noqa: E402


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[StackDir]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["KVMESH_STATE_DIR"] = str(tmp_path / "state")
    env["KVMESH_STACK__STOP_GRACE_S"] = "5"
    env["KVMESH_ENGINE__BACKEND"] = "native"  # stacks of kvmesh's own engine (tests/connectors run vLLM's)
    env["KVMESH_STACK__SERVICES_PACKAGE"] = "kvmesh.services"
    sd = StackDir(state_dir=tmp_path / "state", env=env)
    try:
        yield sd
    finally:
        sd.kill_leftovers()
