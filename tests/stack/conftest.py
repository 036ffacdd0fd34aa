"""Fixtures of the stack tests (the harness itself is in stack_harness.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from stack_harness import SVC_PACKAGE, SVC_PATH, StackDir


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[StackDir]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["KVMESH_STATE_DIR"] = str(tmp_path / "state")
    env["KVMESH_STACK__STOP_GRACE_S"] = "5"
    env["KVMESH_ENGINE__BACKEND"] = "native"  # stacks of kvmesh's own engine (tests/connectors run vLLM's)
    # services come from the test package (one `echo` service), not from whatever `services/` holds today
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SVC_PATH), env.get("PYTHONPATH")]))
    env["KVMESH_STACK__SERVICES_PACKAGE"] = SVC_PACKAGE
    sd = StackDir(state_dir=tmp_path / "state", env=env)
    try:
        yield sd
    finally:
        sd.kill_leftovers()


@pytest.fixture
def model_stub(tmp_path: Path) -> Path:
    """A dir that passes `up --model`'s check; the test service never loads it (the tiny preset costs seconds)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model
