"""The `kvmesh bench agents` workload: trajectories as OpenAI tool-calling loops (the bench itself runs stacks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvmesh.bench.agent_workload import TRAJ_DIR, build_agent_workload

SYSTEM = "You are an agent.\nCOMMANDS:\nopen:\n  docstring: opens a file\n"


def write_traj(root: Path) -> Path:
    traj = root / TRAJ_DIR
    traj.mkdir(parents=True)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the bug."}]
    for i, action in enumerate(["open a.py", "ls -la", "submit"]):
        history += [{"role": "assistant", "content": f"step {i}", "thought": f"think {i}", "action": action},
                    {"role": "user", "content": f"observation {i}"}]
    (traj / "one.traj").write_text(json.dumps({"history": history, "trajectory": [
        {"action": "open a.py", "execution_time": 0.25}]}))
    return root


def test_calls_extend_each_other_as_tool_loops(tmp_path: Path) -> None:
    root = write_traj(tmp_path / "a" / "repo")  # TRAJ_DIR climbs out of the repo root
    w = build_agent_workload(root, 2, seed=3, max_steps=5)
    assert w == build_agent_workload(root, 2, seed=3, max_steps=5)  # seeded: the same run twice
    a, b = w.sessions
    assert [s.tool for s in a.steps] == ["open", "bash", "bash"]  # declared command, else the shell
    assert a.steps[0].tool_s == 0.25 and 0 < a.steps[1].tool_s <= 6.0  # recorded, else drawn (capped)
    assert {t["function"]["name"] for t in w.tools} == {"open", "bash"}
    for k in range(1, len(a.steps) + 1):
        before, now = a.messages(k - 1), a.messages(k)
        assert now[:len(before)] == before and len(now) == len(before) + 2
        call, result = now[-2], now[-1]
        assert call["tool_calls"][0]["function"]["name"] == a.steps[k - 1].tool
        assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"command": a.steps[k - 1].command}
        assert result == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"],
                          "content": f"observation {k - 1}"}
    assert a.messages(0)[1] != b.messages(0)[1]  # two copies of one trajectory are distinct sessions
    assert a.start_s == 0.0 < b.start_s and w.requests == 2 * (3 + 1)


def test_no_trajectories_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        build_agent_workload(tmp_path / "b" / "repo", 2)
