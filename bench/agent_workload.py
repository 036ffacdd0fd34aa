"""The agent sessions of `kvmesh bench agents`: SWE-agent trajectories replayed as OpenAI tool-calling loops.

Each trajectory (`../shared/workloads/swe-agent/*.traj`, its `history`) is
one agent run: a system prompt, a task, then steps of (thought + action,
observation). A step becomes what an agent framework sends today: the
assistant message with the action as a `tool_calls` entry (named as the
trace builder names it, `kvmesh.sim.trajectories.tool_names`: a declared
SWE-agent command, else `bash`; its argument the whole command line) and a
`tool` message with the observation. Call k of a session sends the history up to
step k, so every request extends the one before it. The recorded answers are
replayed, not the model's (a CPU-sized synthetic model writes noise), so both
modes of the bench send byte-identical prompts.

Between two calls the agent "runs the tool": the step's recorded
`execution_time` when the trajectory has one, else a seeded draw from a
log-normal with median `tool_median_s` (sigma `tool_sigma`), capped at
`tool_cap_s`. Sessions start at seeded Poisson arrivals (`arrival_rate` per
second); copies of one trajectory are distinct sessions (their task message
names the copy, so only the shared system prompt is common to them).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kvmesh.sim.trajectories import SHELL_TOOL, declared_commands, tool_names

TRAJ_DIR = Path("../shared/workloads/swe-agent")  # relative to the repo root


@dataclass(frozen=True, slots=True)
class Step:
    thought: str
    tool: str
    command: str
    observation: str
    tool_s: float  # how long the agent runs the tool before its next call


@dataclass(frozen=True, slots=True)
class AgentSession:
    name: str
    start_s: float  # arrival offset from the start of the run
    system: str
    task: str
    steps: tuple[Step, ...]

    def messages(self, k: int) -> list[dict]:
        """The chat of call k (0-based): system, task, then steps 0..k-1 as tool calls and results."""
        out: list[dict] = [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]
        for i, step in enumerate(self.steps[:k]):
            call_id = f"call_{i}"
            out.append({"role": "assistant", "content": step.thought, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": step.tool, "arguments": json.dumps({"command": step.command})}}]})
            out.append({"role": "tool", "tool_call_id": call_id, "content": step.observation})
        return out


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    sessions: tuple[AgentSession, ...]
    tools: list[dict]

    @property
    def requests(self) -> int:
        return sum(len(s.steps) + 1 for s in self.sessions)


def _steps(path: Path, rng: random.Random, median_s: float, sigma: float, cap_s: float,
           max_steps: int) -> tuple[str, str, list[Step]]:
    data = json.loads(path.read_text())
    history = data.get("history") or []
    timings = [float(t.get("execution_time") or 0.0) for t in data.get("trajectory") or []]
    system = str(history[0].get("content", "")) if history and history[0].get("role") == "system" else ""
    declared = declared_commands(system)
    task = next((str(m.get("content", "")) for m in history[1:] if m.get("role") == "user"), "")
    steps: list[Step] = []
    body = history[2:] if system else history[1:]
    for i, msg in enumerate(body):
        if msg.get("role") != "assistant" or not msg.get("action"):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else {}
        observation = str(nxt.get("content", "")) if nxt.get("role") in ("user", "tool") else ""
        recorded = timings[len(steps)] if len(steps) < len(timings) else 0.0
        drawn = min(cap_s, median_s * math.exp(sigma * rng.gauss(0.0, 1.0)))
        tool = (tool_names(msg, declared) or (SHELL_TOOL,))[0]
        steps.append(Step(str(msg.get("thought") or msg.get("content") or ""), tool,
                          str(msg["action"]).strip(), observation, min(cap_s, recorded) if recorded > 0 else drawn))
        if len(steps) >= max_steps:
            break
    return system, task, steps


def build_agent_workload(repo_root: Path, sessions: int, *, seed: int = 0, arrival_rate: float = 1.0,
                         tool_median_s: float = 1.5, tool_sigma: float = 0.6, tool_cap_s: float = 6.0,
                         max_steps: int = 12) -> AgentWorkload:
    """`sessions` sessions drawn round-robin from the trajectories (sorted by name); raises if there are none."""
    trajs = sorted((repo_root / TRAJ_DIR).glob("*.traj"))
    if not trajs:
        raise FileNotFoundError(f"no trajectories under {repo_root / TRAJ_DIR}")
    rng = random.Random(seed)
    out: list[AgentSession] = []
    tools: set[str] = set()
    t = 0.0
    for i in range(sessions):
        path = trajs[i % len(trajs)]
        system, task, steps = _steps(path, rng, tool_median_s, tool_sigma, tool_cap_s, max_steps)
        if not steps:
            continue
        tools.update(s.tool for s in steps)
        out.append(AgentSession(f"{path.stem}-{i}", t, system, f"[run {i}] {task}", tuple(steps)))
        t += rng.expovariate(arrival_rate)
    schema = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    return AgentWorkload(tuple(out), [{"type": "function", "function": {
        "name": name, "description": f"The agent's `{name}` command.", "parameters": schema}} for name in sorted(tools)])
